"""One diagram per engine component, drawn as inline SVG for the lecture decks (course/slides.py inserts each
after the first slide of the section named in ``DIAGRAMS``): the block table (05), the batching timeline (06),
speculative verification (08) and the tensor-parallel split (10).

Each function returns ``(caption markdown, notes HTML, SVG markup)``. The SVG is drawn at the size the slide shows
it (``WIDTH`` × its height, 1 user unit = 1 CSS px), so its text sizes are the sizes a projector shows: never below
18 px, which the deck's browser test checks like any other text. No external assets, no scripts. Where a diagram
shows a schedule (06: the library's ``slot_timeline``) or an accept/reject outcome (08) it is computed, not drawn
by hand, so the picture cannot disagree with its own numbers.
"""

from __future__ import annotations

from html import escape

from minillm.course.slot_model import slot_timeline

WIDTH = 1168  # the slide's inner width, px
FG, MUTED, ACCENT = "#1d232b", "#5b6570", "#b3261e"
BLUE, BLUE_FILL = "#3b6ea8", "#dbe7f5"
GREEN, GREEN_FILL = "#2e7d32", "#dcefdc"
RED_FILL, GREY_FILL, GREY = "#f6d5d2", "#eceff1", "#9aa3ab"
TEXT = 20  # px, the diagrams' body text (the deck's floor is 18)
SMALL = 18


def _text(x: float, y: float, s: str, *, size: int = TEXT, anchor: str = "start", weight: str = "normal",
          fill: str = FG) -> str:
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{fill}">{escape(s)}</text>')


def _rect(x: float, y: float, w: float, h: float, *, fill: str = "none", stroke: str = FG, dash: bool = False,
          width: float = 1.5) -> str:
    extra = ' stroke-dasharray="5 4"' if dash else ""
    return (f'<rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" height="{h:.0f}" rx="4" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{width}"{extra}/>')


def _arrow(x1: float, y1: float, x2: float, y2: float, *, color: str = MUTED, marker: str) -> str:
    return (f'<line x1="{x1:.0f}" y1="{y1:.0f}" x2="{x2:.0f}" y2="{y2:.0f}" stroke="{color}" stroke-width="2" '
            f'marker-end="url(#{marker})"/>')


def _svg(height: int, body: list[str], label: str, marker: str) -> str:
    """The SVG element at 1 user unit per CSS px, with one arrowhead marker (ids are per diagram)."""
    return (f'<svg class="diagram" role="img" aria-label="{escape(label, quote=True)}" width="{WIDTH}" '
            f'height="{height}" viewBox="0 0 {WIDTH} {height}" xmlns="http://www.w3.org/2000/svg" '
            f'font-family="DejaVu Sans, sans-serif">\n'
            f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{MUTED}"/></marker></defs>\n'
            + "\n".join(body) + "\n</svg>")


def block_table() -> tuple[str, str, str]:
    """05: two sequences after a fork, their block tables, and the physical KV pool with reference counts; a
    physical block and every logical block that maps to it share one colour (the table holds the numbers)."""
    size, cell = 4, 26  # tokens per block; one slot's square, px
    seqs = {"A": ([4, 4, 2], [7, 2, 9]), "B": ([4, 3], [7, 4])}  # filled slots per logical block; block table
    ref = {7: 2, 2: 1, 9: 1, 4: 1}
    colour = {7: ("#fbe3c8", "#c46a00"), 2: (BLUE_FILL, BLUE), 9: (GREEN_FILL, GREEN), 4: ("#e8def5", "#6a4fa3")}
    body, rows_y = [], {"A": 80, "B": 250}
    body.append(_text(0, 28, "logical blocks (4 slots each)", weight="bold"))
    body.append(_text(450, 28, "block table", weight="bold"))
    body.append(_text(800, 28, "KV pool: physical blocks", weight="bold"))
    for b in range(10):
        x, y = 800 + (b // 5) * 190, 48 + (b % 5) * 52
        if b in ref:
            fill, stroke = colour[b]
            body.append(_rect(x, y, 170, 40, fill=fill, stroke=stroke, width=2))
            body.append(_text(x + 85, y + 27, f"{b} · ref {ref[b]}", anchor="middle", weight="bold"))
        else:
            body.append(_rect(x, y, 170, 40, fill=GREY_FILL, stroke=GREY, dash=True))
            body.append(_text(x + 85, y + 27, f"{b} · free", size=SMALL, anchor="middle", fill=MUTED))
    for name, (filled, table) in seqs.items():
        y = rows_y[name]
        body.append(_text(0, y, f"sequence {name}", weight="bold"))
        for k, (n, b) in enumerate(zip(filled, table, strict=True)):
            x0 = k * 124
            fill, stroke = colour[b]
            for s in range(size):
                body.append(_rect(x0 + s * (cell + 2), y + 16, cell, cell,
                                  fill=stroke if s < n else "white", stroke=stroke, width=1.5))
            body.append(_text(x0 + 2 * (cell + 2), y + 70, f"logical {k}", size=SMALL, anchor="middle",
                              fill=MUTED))
            body.append(_rect(450 + k * 70, y + 10, 60, 40, fill=fill, stroke=stroke, width=2))
            body.append(_text(480 + k * 70, y + 38, str(b), anchor="middle", weight="bold"))
    body.append(_text(0, 372, "B forked from A after A's first block: both tables hold block 7 (ref count 2).",
                      size=SMALL))
    body.append(_text(0, 400, "A block is taken only when the last one is full: a sequence wastes under one block.",
                      size=SMALL))
    body.append(_text(0, 428, "A sequence that must write into a shared block first copies it (copy-on-write).",
                      size=SMALL))
    caption = "A block table maps a sequence's logical blocks to physical blocks anywhere in the pool."
    notes = ("<p>Sequences A and B share their first block (a fork, or a prefix-cache hit): the pool keeps one "
             "copy with a reference count of 2. Growth takes one free block at a time, so the waste per sequence "
             "is at most one partly filled block, not a whole maximum-length reservation. Colours pair each "
             "logical block with the physical block its table entry names.</p>")
    return caption, notes, _svg(440, body, "block tables pointing into a paged KV pool", "bt-arrow")


def batching_timeline() -> tuple[str, str, str]:
    """06: the same requests on 4 slots, static vs continuous batching, step by step."""
    lengths, slots = [3, 8, 4, 6, 5, 2, 4, 3], 4
    colors = ["#dbe7f5", "#dcefdc", "#fbe3c8", "#e8def5", "#f6d5d2", "#d5eef0", "#f3efc4", "#e0e0e0"]
    cw, ch, x0 = 44, 30, 150
    body = []
    panels = [("static", False, 40), ("continuous", True, 250)]
    totals = {}
    for name, continuous, y0 in panels:
        steps = slot_timeline(lengths, slots, "continuous" if continuous else "static")
        totals[name] = len(steps)
        body.append(_text(0, y0 - 10, f"{name} batching: {len(steps)} steps", weight="bold"))
        for s in range(slots):
            body.append(_text(x0 - 14, y0 + s * (ch + 4) + 21, f"slot {s}", size=SMALL, anchor="end", fill=MUTED))
        for t, held in enumerate(steps):
            for s, h in enumerate(held):
                x, y = x0 + t * cw, y0 + s * (ch + 4)
                if h is None:
                    body.append(_rect(x, y, cw - 4, ch, fill=GREY_FILL, stroke=GREY, dash=True, width=1))
                else:
                    body.append(_rect(x, y, cw - 4, ch, fill=colors[h], stroke=FG, width=1))
                    body.append(_text(x + (cw - 4) / 2, y + 21, f"R{h + 1}", size=SMALL, anchor="middle"))
    bubble = slot_timeline(lengths, slots, "static")
    idle = sum(h is None for held in bubble for h in held)
    body.append(_text(0, 414, f"Requests R1–R8 need {', '.join(map(str, lengths))} decode steps, on 4 slots.",
                      size=SMALL))
    body.append(_text(0, 440, f"Static: a finished request's slot idles until the batch's longest ends ({idle} idle "
                              "slot-steps, grey).", size=SMALL))
    body.append(_text(0, 466, "Continuous: the next request takes the freed slot at the next step.", size=SMALL))
    caption = (f"Continuous batching refills a slot the step after it frees: {totals['continuous']} steps instead "
               f"of {totals['static']} here.")
    notes = ("<p>Both timelines run the same eight requests on four slots, scheduled by the library's slot model "
             "(<code>slot_timeline</code>, exercise 6.1's rule: the diagram is computed, not drawn). "
             "Static batching waits for the whole batch; the grey cells are "
             "its bubble. Continuous (iteration-level) batching admits a waiting request at every step, which is "
             "what the engine's scheduler does.</p>")
    return caption, notes, _svg(476, body, "static and continuous batching timelines", "bt6-arrow")


def speculative_verification() -> tuple[str, str, str]:
    """08: a draft proposes γ = 4 tokens; one target forward scores all of them; accept, reject and resample."""
    draft = ["the", "cat", "sat", "in", "a"]  # the context's last token, then γ = 4 guesses
    p = [0.60, 0.50, 0.05, 0.40]  # target probability of each guess
    q = [0.50, 0.45, 0.40, 0.30]  # draft probability of each guess
    u = [0.30, 0.70, 0.60, 0.10]  # the uniform draws
    outcome = []
    for pi, qi, ui in zip(p, q, u, strict=True):  # exercise 8.1's test: accept while u < min(1, p/q)
        if outcome and outcome[-1] != "accept":
            outcome.append("dropped")
        else:
            outcome.append("accept" if ui < min(1.0, pi / qi) else "reject")
    body, bw, gap, x0 = [], 150, 36, 40
    body.append(_text(0, 30, "draft proposes γ = 4 tokens, one at a time (cheap)", weight="bold"))
    for k, tok in enumerate(draft):
        x = x0 + k * (bw + gap)
        body.append(_rect(x, 50, bw, 48, fill=GREY_FILL if k == 0 else BLUE_FILL))
        body.append(_text(x + bw / 2, 82, tok, anchor="middle", weight="bold"))
        if k:
            body.append(_arrow(x - gap + 2, 74, x - 4, 74, marker="sv-arrow"))
    body.append(_text(0, 150, "target scores all 5 positions in one forward (about one decode step)",
                      weight="bold"))
    body.append(_rect(x0, 165, 5 * bw + 4 * gap, 40, fill="#fbe3c8"))
    body.append(_text(x0 + (5 * bw + 4 * gap) / 2, 192, "target model: p(token | prefix) at every position",
                      anchor="middle", size=SMALL))
    for k, (pi, qi, ui, result) in enumerate(zip(p, q, u, outcome, strict=True)):
        x = x0 + (k + 1) * (bw + gap)
        fill = {"accept": GREEN_FILL, "reject": RED_FILL, "dropped": GREY_FILL}[result]
        stroke = {"accept": GREEN, "reject": ACCENT, "dropped": GREY}[result]
        body.append(_rect(x, 235, bw, 120, fill=fill, stroke=stroke))
        body.append(_text(x + bw / 2, 262, f"p {pi:.2f} · q {qi:.2f}", size=SMALL, anchor="middle"))
        body.append(_text(x + bw / 2, 290, f"u {ui:.2f} vs {min(1, pi / qi):.2f}", size=SMALL, anchor="middle"))
        word = {"accept": "✓ accept", "reject": "✗ reject", "dropped": "dropped"}[result]
        body.append(_text(x + bw / 2, 330, word, anchor="middle", weight="bold", fill=stroke))
    rejected = outcome.index("reject") if "reject" in outcome else None
    if rejected is not None:
        x = x0 + (rejected + 1) * (bw + gap)
        body.append(_arrow(x + bw / 2, 357, x + bw / 2, 383, marker="sv-arrow"))
        body.append(_text(x + bw / 2, 408, "resample from max(0, p − q)", size=SMALL, anchor="middle"))
    kept = outcome.count("accept") + 1
    body.append(_text(0, 448, f"This step yields {kept} tokens ({outcome.count('accept')} accepted + 1 resampled or "
                              "bonus); the dropped guesses' KV slots are rolled back.", size=SMALL))
    caption = "Accept each guess with probability min(1, p/q); at the first rejection, resample and drop the rest."
    notes = ("<p>The outcome shown is computed from the p, q and u printed on the slide with exercise 8.1's "
             "accept test (u &lt; min(1, p/q)). "
             "When every guess is accepted, the target's distribution at the last position gives a bonus "
             "token for free, so a step yields between 1 and γ + 1 tokens, and the output follows the target's "
             "distribution exactly.</p>")
    return caption, notes, _svg(460, body, "speculative decoding: draft, one verification forward, accept/reject",
                                "sv-arrow")


def tp_split() -> tuple[str, str, str]:
    """10: an MLP over two devices, W1 split by columns, W2 by rows, one all-reduce at the end."""
    body, lane = [], {0: 70, 1: 270}
    body.append(_text(0, 28, "x [tokens × hidden] is on both devices", weight="bold"))
    for d, y in lane.items():
        body.append(_rect(0, y - 10, 950, 160, fill="#fafbfc", stroke=GREY, dash=True, width=1))
        body.append(_text(14, y + 18, f"device {d}", weight="bold", fill=MUTED))
        body.append(_rect(30, y + 40, 110, 60, fill=GREY_FILL))
        body.append(_text(85, y + 77, "x", anchor="middle", weight="bold"))
        body.append(_arrow(142, y + 70, 196, y + 70, marker="tp-arrow"))
        body.append(_rect(200, y + 20, 210, 100, fill=BLUE_FILL, stroke=BLUE))
        body.append(_text(305, y + 62, f"W1[:, half {d}]", anchor="middle", weight="bold"))
        body.append(_text(305, y + 92, "columns: no talk", size=SMALL, anchor="middle", fill=MUTED))
        body.append(_arrow(412, y + 70, 466, y + 70, marker="tp-arrow"))
        body.append(_rect(470, y + 40, 150, 60, fill=GREY_FILL))
        body.append(_text(545, y + 77, f"act(h{d})", anchor="middle"))
        body.append(_arrow(622, y + 70, 676, y + 70, marker="tp-arrow"))
        body.append(_rect(680, y + 20, 210, 100, fill=GREEN_FILL, stroke=GREEN))
        body.append(_text(785, y + 62, f"W2[half {d}, :]", anchor="middle", weight="bold"))
        body.append(_text(785, y + 92, "rows: partial sums", size=SMALL, anchor="middle", fill=MUTED))
        body.append(_arrow(892, y + 70, 966, 205 if d == 0 else 235, marker="tp-arrow"))
    body.append(_rect(970, 170, 190, 100, fill="#fbe3c8", stroke=ACCENT, width=2))
    body.append(_text(1065, 212, "all-reduce", anchor="middle", weight="bold", fill=ACCENT))
    body.append(_text(1065, 242, "y = y0 + y1", anchor="middle"))
    body.append(_text(0, 448, "Per decoder layer: one all-reduce after attention, one after the MLP, of "
                              "[tokens × hidden] each.", size=SMALL))
    caption = "Split W1 by columns and W2 by rows: each device works alone until one all-reduce sums the halves."
    notes = ("<p>Column parallelism needs no communication (each device computes its own slice of the hidden "
             "activation, and the activation is elementwise); row parallelism leaves each device with a partial "
             "sum of the full output, which one all-reduce adds up. Attention splits the same way, by heads. "
             "Megatron-LM's layout, and exercise 10.1's.</p>")
    return caption, notes, _svg(460, body, "tensor parallelism: column then row split, one all-reduce", "tp-arrow")


DIAGRAMS = {  # deck number → (the section it illustrates: heading prefix, its diagram)
    "05": ("3. Build: growing a sequence", block_table),
    "06": ("2. Build: one step of static and continuous batching", batching_timeline),
    "08": ("2. Build: the accept/resample rule", speculative_verification),
    "10": ("1. Split a linear layer", tp_split),
}
