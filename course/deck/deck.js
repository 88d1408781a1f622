// The lecture decks' runtime, inlined into every slides/NN_name.html by course/slides.py: navigation
// (arrows, space, click, Home/End), the speaker notes ('n'), full screen ('f'), the stage scaled to the window.
(function () {
  const slides = Array.from(document.querySelectorAll('.slide'));
  const stage = document.getElementById('stage'), notes = document.getElementById('notes');
  const bar = document.getElementById('bar'), count = document.getElementById('count');
  let i = Math.max(0, Math.min(slides.length - 1, (parseInt(location.hash.slice(1), 10) || 1) - 1));
  function fit() {  // scale the 1280x720 stage to the window (above the notes panel when it is open)
    const h = window.innerHeight * (document.body.classList.contains('notes-open') ? 0.66 : 1);
    const s = Math.min(window.innerWidth / 1280, h / 720);
    const x = (window.innerWidth - 1280 * s) / 2, y = (h - 720 * s) / 2;
    stage.style.transform = 'translate(' + x + 'px,' + y + 'px) scale(' + s + ')';
  }
  function show(n) {
    i = Math.max(0, Math.min(slides.length - 1, n));
    slides.forEach((s, k) => s.classList.toggle('active', k === i));
    const aside = slides[i].querySelector('.notes');
    notes.innerHTML = aside ? aside.innerHTML : '<p><em>No notes.</em></p>';
    bar.style.width = (100 * (i + 1) / slides.length) + '%';
    count.textContent = (i + 1) + ' / ' + slides.length;
    history.replaceState(null, '', '#' + (i + 1));
  }
  document.addEventListener('keydown', (e) => {
    if (['ArrowRight', 'PageDown', ' ', 'ArrowDown'].includes(e.key)) { show(i + 1); e.preventDefault(); }
    else if (['ArrowLeft', 'PageUp', 'ArrowUp'].includes(e.key)) { show(i - 1); e.preventDefault(); }
    else if (e.key === 'Home') show(0);
    else if (e.key === 'End') show(slides.length - 1);
    else if (e.key === 'n') { document.body.classList.toggle('notes-open'); fit(); }
    else if (e.key === 'f' && document.documentElement.requestFullscreen) document.documentElement.requestFullscreen();
  });
  document.addEventListener('click', (e) => {
    if (e.target.closest('a, pre, table, #notes')) return;
    show(e.clientX > window.innerWidth / 3 ? i + 1 : i - 1);
  });
  window.addEventListener('resize', fit);
  fit();
  show(i);
})();
