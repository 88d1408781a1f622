"""Structured output and tools through the server, live on 127.0.0.1 with the default model and real clients: the
``openai`` SDK (response_format, ``parse`` with a pydantic model, vLLM's guided_* extras, tools with a named
function and "required", streaming) and the ``llm`` CLI's ``--schema``; bad constraints are 400s naming the field.
"""

import json
import os
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the serve extra)")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel  # noqa: E402

from minillm import EngineConfig, LLMEngine  # noqa: E402
from minillm.entrypoints.openai.server import build_app  # noqa: E402
from minillm.entrypoints.openai.tools import ToolPlan, tool_plan  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_openai_server import MODEL, LiveServer, assert_still_serves  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def live(default_llm):
    engine = LLMEngine(default_llm.model, default_llm.tokenizer, EngineConfig(max_num_seqs=8))
    server = LiveServer(build_app(engine, max_queue=32))
    yield server
    server.stop()


def chat(live, **kw):
    return live.client().chat.completions.create(model=MODEL, messages=ASK, **{"max_tokens": 60, "temperature": 0,
                                                                                **kw})


def test_json_schema_response_format_validates(live):
    r = chat(live, response_format={"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_response_format_is_a_json_object(live):
    r = chat(live, response_format={"type": "json_object"}, temperature=1.0, seed=1)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_sdk_parse_with_a_pydantic_model(live):
    class City(BaseModel):
        name: str
        population: int

    r = live.client().chat.completions.parse(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                             response_format=City)
    assert isinstance(r.choices[0].message.parsed, City)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
    ({"guided_regex": r"[0-9]{2} degrees"}, lambda t: re.fullmatch(r"[0-9]{2} degrees", t)),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    # vLLM's current form of the same extras
    ({"structured_outputs": {"choice": ["sunny", "rainy"]}}, lambda t: t in ("sunny", "rainy")),
    ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_vllm_guided_extras_on_completions_and_chat(live, extra, check):
    r = live.client().completions.create(model=MODEL, prompt="The weather today:", max_tokens=40, temperature=1.0,
                                         seed=2, extra_body=extra)
    assert check(r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = chat(live, extra_body=extra)
    assert check(r.choices[0].message.content)


def test_guided_decoding_backend_minillm_constrains_with_the_engines_regex_dfa(live):
    pattern = r"[0-9]{2} degrees"
    extra = {"guided_regex": pattern, "guided_decoding_backend": "minillm"}
    r = live.client().completions.create(model=MODEL, prompt="The weather today:", max_tokens=40, temperature=1.0,
                                         seed=2, extra_body=extra)
    assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(live, stream=True, extra_body=extra)
                       if c.choices)
    assert re.fullmatch(pattern, streamed)
    # both backends allow exactly the tokens that keep the regex alive: greedy answers are equal
    mine = chat(live, extra_body=extra).choices[0].message.content
    assert mine == chat(live, extra_body={**extra, "guided_decoding_backend": "xgrammar"}).choices[0].message.content
    # the request really goes to the backend it names: \x41 is outside minillm's regex subset, inside xgrammar's
    assert chat(live, max_tokens=8, extra_body={"guided_regex": r"\x41{3}"}).choices[0].message.content == "AAA"
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, extra_body={"guided_regex": r"\x41{3}", "guided_decoding_backend": "minillm"})
    assert e.value.body["param"] == "guided_regex" and "minillm backend" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, extra_body={"guided_regex": "a", "guided_decoding_backend": "llguidance"})
    assert "xgrammar, minillm" in e.value.body["message"] and "'llguidance'" in e.value.body["message"]
    assert_still_serves(live)


def test_streamed_json_schema_joins_to_valid_json(live):
    stream = chat(live, stream=True, response_format={"type": "json_schema",
                                                      "json_schema": {"name": "p", "schema": PERSON}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_named_tool_choice_returns_a_call_whose_arguments_validate(live):
    r = chat(live, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_calls_given_tools_with_valid_arguments(live):
    r = chat(live, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=5, max_tokens=120)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    one = chat(live, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    assert len(one.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_join_to_the_non_streamed_call(live):
    kw = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = chat(live, **kw).choices[0].message.tool_calls[0]
    chunks = [c for c in chat(live, stream=True, **kw) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    stream = chat(live, stream=True, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120)
    calls = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)


def test_auto_tool_choice_parses_a_reply_that_is_a_call_and_keeps_text_as_content():
    plan = tool_plan([WEATHER, TIME], "auto", None)
    assert plan.schema() is None  # "auto" does not constrain
    (call,) = plan.parse('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
    assert len(plan.parse('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {}}]')) == 2
    assert plan.parse("It is sunny.") == [] and plan.parse('{"name": "unknown", "arguments": {}}') == []
    assert tool_plan([WEATHER], "none", None) is None and tool_plan([], "auto", None) is None
    assert tool_plan([WEATHER], None, None).choice == "auto"  # OpenAI's default with tools
    assert ToolPlan((WEATHER["function"],), "required", parallel=False).schema()["maxItems"] == 1


def test_auto_tool_choice_answers_through_the_server(live):
    r = chat(live, tools=[WEATHER], tool_choice="auto", max_tokens=20)
    message = r.choices[0].message
    assert message.content or message.tool_calls


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"guided_regex": "a("}}, "guided_regex"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"guided_json": {"enum": []}}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"guided_regex": "a", "guided_decoding_backend": "outlines"}}, "guided_decoding_backend"),
    ({"extra_body": {"guided_decoding_backend": "outlines"}}, "guided_decoding_backend"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_decoding_backend": "minillm"}},
     "guided_decoding_backend"),
    ({"extra_body": {"guided_regex": r"\x41", "guided_decoding_backend": "minillm"}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {"regex": "a("}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "{}"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": ["a"]}}, "structured_outputs"),
    ({"extra_body": {"guided_regex": "a", "structured_outputs": {"regex": "b"}}}, "structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_field(live, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert_still_serves(live)


@pytest.mark.skipif(find_spec("llm") is None, reason="the llm CLI is not installed (dev extra)")
def test_llm_cli_schema_returns_json_that_validates(live, tmp_path):
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: minillm\n  model_name: {MODEL}\n  api_base: {live.url}/v1\n  supports_schema: true\n")
    env = {**os.environ, "LLM_LOAD_PLUGINS": "", "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "unused"}
    llm = Path(sys.executable).with_name("llm")
    # Bounded fields: with llm's concise "name, age int" the grammar admits an integer of any length, and the
    # default model can spend every token on zeros (valid so far, cut at max_tokens); bounds make 60 tokens enough.
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    r = subprocess.run([str(llm), "-m", "minillm", "--schema", json.dumps(schema), "-o", "max_tokens", "60",
                        "-o", "temperature", "0", "--no-log", "Invent a person."],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    value = json.loads(r.stdout)
    jsonschema.validate(value, schema)


def test_bench_serve_measures_the_json_schema_as_served_and_on_equal_work(live, tmp_path, capsys):
    from minillm.entrypoints.bench_serve import bench_serve_main
    from minillm.perf.bench.serve import bench_serve, equal_work_schema, mean_output_tokens

    result = bench_serve(live.url, [float("inf")], 3, seed=1, max_tokens=24, progress=False, save=False,
                         json_schema=PERSON)
    plain, constrained = result["runs"][0], result["runs_json_schema"][0]
    assert plain["completed"] == constrained["completed"] == 3
    assert [r["prompt_tokens"] for r in plain["requests"]] == [r["prompt_tokens"] for r in constrained["requests"]]
    out = capsys.readouterr().out
    assert constrained["output_throughput"] > 0 and "json_schema" in out
    for run in (plain, constrained):  # each run's mean answer length is printed beside its throughput
        tokens = [r["output_tokens"] for r in run["requests"]]
        assert mean_output_tokens(run) == sum(tokens) / 3 and f"({sum(tokens) / 3:.1f} tok)" in out
    # equal work: both runs of the second pair emit max_tokens tokens per request on the same prompts
    equal = result["runs_equal_work"]
    assert equal["schema"] == equal_work_schema(PERSON, 24)
    for run in (equal["unconstrained"][0], equal["json_schema"][0]):
        assert [r["output_tokens"] for r in run["requests"]] == [24, 24, 24]
        assert [r["prompt_tokens"] for r in run["requests"]] == [r["prompt_tokens"] for r in plain["requests"]]
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith("inf ")]
    assert [r[1:3] for r in rows] == [["as", "served"], ["equal", "work"]]
    assert "not equal work" not in out
    bad = tmp_path / "schema.json"
    bad.write_text("[1, 2]")
    assert bench_serve_main(["--base-url", live.url, "--json-schema", str(bad), "--no-save"]) == 2
    assert "a JSON schema is an object" in capsys.readouterr().err


def test_equal_work_schema_admits_no_answer_shorter_than_max_tokens_items():
    from minillm.perf.bench.serve import equal_work_schema

    schema = equal_work_schema(PERSON, 5)
    item = {"name": "a", "age": 1}
    jsonschema.validate([item] * 5, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([item] * 4, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([item] * 4 + [{"name": 3}], schema)  # the items still follow the given schema
    with pytest.raises(ValueError, match="max_tokens"):
        equal_work_schema(PERSON, 0)
    # a schema with references (pydantic writes them so) keeps them resolvable from the new root
    referring = {"type": "object", "properties": {"who": {"$ref": "#/$defs/P"}}, "required": ["who"],
                 "$defs": {"P": PERSON}}
    wrapped = equal_work_schema(referring, 2)
    jsonschema.validate([{"who": item}] * 2, wrapped)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"who": {"name": 3}}] * 2, wrapped)


def test_a_bad_constraint_leaves_a_running_stream_untouched(live):
    kw = {"model": MODEL, "prompt": "Count to ten:", "max_tokens": 24, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    alone = live.client().completions.create(**kw).choices[0].text
    stream = iter(live.client().completions.create(stream=True, **kw))
    chunks = [next(stream)]  # the request is running in the engine now
    with pytest.raises(openai.BadRequestError):
        chat(live, extra_body={"guided_regex": "a("})
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == alone
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
