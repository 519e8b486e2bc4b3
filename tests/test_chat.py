"""Chat mode: the prompt rendered by the checkpoint's template equals transformers' apply_chat_template with
Qwen3.5's own template (tests/fixtures/qwen35_chat_template.jinja), token for token, on a set of conversations;
the CLI builds its prompt, stops and --json fields from it; reasoning and answer are shown apart."""
import hashlib
import json
import os
import shutil

import pytest
from hypothesis import given, strategies as st

import dflash
import engine
import chat
import generate
from helpers import save_hf_causal_lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "qwen35_chat_template.jinja")
# sha256 of chat_template.jinja as shipped with mlx-community/Qwen3.5-35B-A3B-4bit (the Qwen3.5 family
# template; the same text is in Qwen/Qwen3.5-27B's tokenizer_config.json). Guards the fixture against edits.
FIXTURE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
QWEN_EXTRA = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]      # special, as in Qwen3.5
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "where": {"near": "Zürich"}}}}
TOOLS = [   # one in the OpenAI/transformers form, one bare function object; non-ASCII kept as is by tojson
    {"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "array", "items": {"type": "integer"}}},
                                                     "required": ["city"]}}},
    {"name": "now", "description": "The current time", "parameters": {"type": "object", "properties": {}}},
]
CONVERSATIONS = {
    "one-turn": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}],
    "trimmed-unicode": [{"role": "system", "content": "  Réponds en français.\n"}, {"role": "user", "content": "\n  naïve 你好 ✓  "}],
    "multi-turn": [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "7", "reasoning_content": "Any will do; 7."},
        {"role": "user", "content": "Double it."}],
    "inline-think": [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "<think>\nHmm, 3.\n</think>\n\n3"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "<think>\nNow 4.\n</think>\n\n4"}],
    "tool-calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool.", "tool_calls": [CALL, CALL]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 19}"}],
    "images": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What is this?"},
                                            {"type": "image", "image": "b.png"}]}],
    "system-list": [{"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
}


@pytest.fixture(scope="module")
def template():
    with open(FIXTURE, encoding="utf-8") as fh:
        return fh.read()


def test_fixture_is_the_published_template():
    with open(FIXTURE, "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == FIXTURE_SHA256


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory, template):
    """A random Qwen3.5 target (saved by transformers) with the embedded BPE tokenizer plus Qwen3.5's chat
    tokens, the Qwen3.5 template as chat_template.jinja, and generation_config naming only <|endoftext|>."""
    from tokenizers import Tokenizer
    root = tmp_path_factory.mktemp("chat")
    tok = Tokenizer.from_file(os.path.join(ROOT, "checkpoints", "tiny-qwen35", "tokenizer.json"))
    tok.add_special_tokens(QWEN_EXTRA)
    tok.add_tokens(QWEN_ADDED)
    d = root / "target"
    save_hf_causal_lm(d, seed=31, vocab_size=tok.get_vocab_size())
    tok.save(str(d / "tokenizer.json"))
    shutil.copy(FIXTURE, d / "chat_template.jinja")
    with open(d / "tokenizer_config.json", "w") as fh:
        json.dump({"tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, fh)
    with open(d / "generation_config.json", "w") as fh:
        json.dump({"eos_token_id": tok.token_to_id("<|endoftext|>")}, fh)
    from transformers import AutoTokenizer
    return {"path": str(d), "root": root, "tok": tok, "hf_tok": AutoTokenizer.from_pretrained(str(d))}


# --------------------------------------------------------------------------------------------------
# rendering == transformers
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_render_equals_transformers(chat_ckpt, template, name, thinking, gen_prompt):
    msgs = CONVERSATIONS[name]
    kw = dict(add_generation_prompt=gen_prompt, enable_thinking=thinking)
    ref = chat_ckpt["hf_tok"].apply_chat_template(msgs, tokenize=False, **kw)
    tpl, specials = chat.load_chat_template(chat_ckpt["path"])
    assert tpl == template
    ours = chat.render_chat(tpl, msgs, special_tokens=specials, **kw)
    assert ours == ref
    ref_ids = chat_ckpt["hf_tok"].apply_chat_template(msgs, tokenize=True, return_dict=False, **kw)
    assert chat_ckpt["tok"].encode(ours, add_special_tokens=False).ids == list(ref_ids)


def test_render_matches_the_documented_shapes(template):
    """Independent of transformers: the shapes of docs/qwen35.md#tokenizer-chat-template-and-stop-tokens, written out by hand."""
    r = lambda msgs, **kw: chat.render_chat(template, msgs, **kw)
    user = [{"role": "user", "content": " hi "}]
    assert r(user) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert r(user, enable_thinking=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert r([{"role": "system", "content": "S"}] + user).startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n")
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "r2"}]
    assert r(turns, add_generation_prompt=False) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"             # before the last query:
        "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\nd<|im_end|>\n")  # reasoning dropped


@pytest.mark.parametrize("msgs,words", [
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "System message must be at the beginning"),
    ([{"role": "system", "content": "only"}], "No user query found"),
    ([{"role": "critic", "content": "x"}, {"role": "user", "content": "a"}], "Unexpected message role"),
    ([], "No messages provided"),
])
def test_refused_conversation_is_one_clear_error(template, msgs, words):
    with pytest.raises(dflash.GenerationError) as e:
        chat.render_chat(template, msgs)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_template_from_tokenizer_config_and_bad_template(tmp_path, template):
    with open(tmp_path / "tokenizer_config.json", "w") as fh:
        json.dump({"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]}, fh)
    assert chat.load_chat_template(str(tmp_path))[0] == template
    assert chat.load_chat_template(str(tmp_path / "..")) == (None, {})
    with pytest.raises(Exception) as e:
        chat.render_chat("{% if %}", [{"role": "user", "content": "a"}])
    assert "does not parse" in str(e.value) and "--no-chat" in str(e.value)


# --------------------------------------------------------------------------------------------------
# the CLI
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["one-turn", "system", "system-list", "tool-calls"])
@pytest.mark.parametrize("thinking", [True, False])
def test_render_with_tools_equals_transformers(chat_ckpt, template, name, thinking):
    """The "# Tools" system block (merged with a system turn when there is one) == transformers' rendering."""
    msgs = CONVERSATIONS[name]
    kw = dict(add_generation_prompt=True, enable_thinking=thinking)
    ref = chat_ckpt["hf_tok"].apply_chat_template(msgs, tools=TOOLS, tokenize=False, **kw)
    ours = chat.render_chat(template, msgs, special_tokens=chat.load_chat_template(chat_ckpt["path"])[1],
                                tools=TOOLS, **kw)
    assert ours == ref and "# Tools" in ours and '"name": "now"' in ours and "Météo" in ours
    assert chat.render_chat(template, msgs, tools=[], **kw) == chat.render_chat(template, msgs, **kw)


def run_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert generate.main([str(a) for a in args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_chat_is_default_and_equals_transformers(chat_ckpt, capsys, tmp_path):
    hf_tok, p = chat_ckpt["hf_tok"], chat_ckpt["path"]
    base = ["--target", p, "--max-new-tokens", 3, "--json", "--dtype", "float32"]
    out = run_json(capsys, *base, "--prompt", "Hello there")
    user = [{"role": "user", "content": "Hello there"}]
    assert out["prompt_ids"] == list(hf_tok.apply_chat_template(user, add_generation_prompt=True, return_dict=False))
    assert out["chat"] and out["thinking"] and isinstance(out["reasoning"], str)
    out = run_json(capsys, *base, "--prompt", "Hello there", "--no-think")
    assert out["prompt_ids"] == list(hf_tok.apply_chat_template(user, add_generation_prompt=True, enable_thinking=False,
                                                                return_dict=False))
    assert not out["thinking"] and out["reasoning"] == ""
    out = run_json(capsys, *base, "--prompt", "Hello there", "--no-chat")
    assert out["prompt_ids"] == chat_ckpt["tok"].encode("Hello there").ids and out["chat"] is False
    # several turns from --messages, a system prompt from --system, the new user turn from --prompt
    f = tmp_path / "m.json"
    f.write_text(json.dumps(CONVERSATIONS["multi-turn"][:2]))
    out = run_json(capsys, *base, "--messages", f, "--system", "Be terse.", "--prompt", "Again")
    conv = [{"role": "system", "content": "Be terse."}, *CONVERSATIONS["multi-turn"][:2], {"role": "user", "content": "Again"}]
    assert out["prompt_ids"] == list(hf_tok.apply_chat_template(conv, add_generation_prompt=True, return_dict=False))
    t = tmp_path / "tools.json"                                        # tool schemas from --tools
    t.write_text(json.dumps(TOOLS, ensure_ascii=False), encoding="utf-8")
    out = run_json(capsys, *base, "--tools", t, "--system", "Be terse.", "--prompt", "Weather in Paris?")
    conv = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Paris?"}]
    assert out["prompt_ids"] == list(hf_tok.apply_chat_template(conv, tools=TOOLS, add_generation_prompt=True,
                                                                return_dict=False))
    f.write_text(json.dumps(CONVERSATIONS["multi-turn"]))              # --messages alone, ending in a user turn
    out = run_json(capsys, *base, "--messages", f)
    assert out["prompt_ids"] == list(hf_tok.apply_chat_template(CONVERSATIONS["multi-turn"], add_generation_prompt=True,
                                                                return_dict=False))


def test_cli_chat_stops_on_im_end(chat_ckpt, capsys, monkeypatch):
    """generation_config names only <|endoftext|>; a chat turn must also end at <|im_end|>."""
    seen = []
    run = engine.Engine.run          # Engine.generate runs its one request through Engine.run
    monkeypatch.setattr(engine.Engine, "run", lambda self, reqs, *a, **k: seen.append(list(reqs[0].stop_ids)) or run(self, reqs, *a, **k))
    tok = chat_ckpt["tok"]
    run_json(capsys, "--target", chat_ckpt["path"], "--prompt", "hi", "--max-new-tokens", 2, "--json")
    assert set(seen[-1]) == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    run_json(capsys, "--target", chat_ckpt["path"], "--prompt", "hi", "--max-new-tokens", 2, "--json", "--no-chat")
    assert seen[-1] == [tok.token_to_id("<|endoftext|>")]


@pytest.mark.parametrize("args,words", [
    (["--chat", "--prompt-ids", "1,2"], "cannot be rendered as a chat"),
    (["--no-chat", "--prompt", "a", "--system", "s"], "--system belongs to chat mode"),
    (["--prompt-ids", "1,2", "--no-think"], "--no-think belongs to chat mode"),
    (["--no-chat", "--prompt", "a", "--system", "s", "--no-think"], "--system, --no-think belong to chat mode"),
    (["--system", "s"], "give a prompt"),
    (["--messages", "{missing}"], "cannot be read"),
    (["--messages", "{bad}"], "must hold a JSON list"),
    (["--messages", "{sysfirst}", "--system", "s", "--prompt", "a"], "keep one"),
    (["--prompt", "a", "--messages", "{latesys}"], "System message must be at the beginning"),
    (["--prompt", "a", "--tools", "{missing}"], "cannot be read"),
    (["--prompt", "a", "--tools", "{bad}"], "must hold a JSON list of tool objects"),
    (["--prompt", "a", "--tools", "{notjson}"], "is not valid JSON"),
    (["--no-chat", "--prompt", "a", "--tools", "{sysfirst}"], "--tools belongs to chat mode"),
])
def test_cli_chat_bad_input(chat_ckpt, args, words):
    root = chat_ckpt["root"]
    (root / "bad.json").write_text(json.dumps({"role": "user"}))
    (root / "sysfirst.json").write_text(json.dumps([{"role": "system", "content": "x"}]))
    (root / "latesys.json").write_text(json.dumps([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]))
    (root / "notjson.json").write_text("[{")
    fill = {"missing": root / "nope.json", "bad": root / "bad.json", "sysfirst": root / "sysfirst.json",
            "latesys": root / "latesys.json", "notjson": root / "notjson.json"}
    with pytest.raises(dflash.GenerationError) as e:
        generate.main(["--target", chat_ckpt["path"], *[str(a).format(**fill) for a in args]])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_chat_without_template_is_an_error():
    with pytest.raises(dflash.GenerationError, match="ships no chat template"):
        generate.main(["--prompt", "hi", "--chat", "--max-new-tokens", "1"])      # the embedded pair has none


# --------------------------------------------------------------------------------------------------
# reasoning and answer apart
# --------------------------------------------------------------------------------------------------

class Out:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_stream_shows_reasoning_and_answer_apart(chat_ckpt):
    tok = chat_ckpt["tok"]
    im_end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Two and two.\n</think>\n\nIt is 4.", add_special_tokens=False).ids + [im_end]
    for chunk in (1, 3, len(ids)):          # one token per step, accepted runs of 3, everything at once
        out = Out()
        s = generate.TextStream(tok, out=out, hide=[im_end], render=chat.chat_display)
        for i in range(0, len(ids), chunk):
            s.push(ids[i:i + chunk])
        s.close()
        assert out.text == "[thinking]\nTwo and two.\n\n[answer]\nIt is 4.\n"
    fields = chat.chat_fields(tok, ids, [im_end], thinking=True)
    assert (fields["reasoning"], fields["content"]) == ("Two and two.", "It is 4.")
    assert chat.split_thinking("no tag yet", True) == ("no tag yet", "")
    assert chat.split_thinking("a</think>b", False) == ("", "a</think>b")


@given(st.lists(st.sampled_from(["a", "é", "\n", "</think>", "</", "think", ">", "<"]), max_size=12))
def test_display_only_grows(pieces):
    """The stream prints the display's new tail at each step, so the display of any prefix of the text
    must be a prefix of the display of the whole text."""
    text = "".join(pieces)
    full = chat.chat_display(text)
    for i in range(len(text) + 1):
        assert full.startswith(chat.chat_display(text[:i]))


# --------------------------------------------------------------------------------------------------
# tool calls in generated text
# --------------------------------------------------------------------------------------------------

TYPED_TOOL = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"}, "late": {"type": "boolean"},
    "rooms": {"type": "array"}, "prefs": {"type": "object"}}}}}
TEXT = st.text(st.characters(blacklist_characters="<\r", blacklist_categories=("Cs",)), max_size=12)
JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | TEXT,
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
ARGS = st.fixed_dictionaries({}, optional={
    "city": TEXT, "nights": st.integers(-1000, 10**9), "budget": st.floats(-1e6, 1e6, allow_nan=False),
    "late": st.booleans(), "rooms": st.lists(JSONISH, max_size=3), "prefs": st.dictionaries(TEXT, JSONISH, max_size=3)})


@given(calls=st.lists(ARGS, min_size=1, max_size=3), content=st.sampled_from(["", "Booking now."]))
def test_tool_calls_round_trip_through_the_template(template, calls, content):
    """Tool calls rendered by Qwen3.5's template as an assistant turn, parsed back with the tool's schema ->
    the same calls: names, argument names and typed values (strings stay strings, even "12" or "true")."""
    tool_calls = [{"type": "function", "function": {"name": "book", "arguments": a}} for a in calls]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": content, "tool_calls": tool_calls}]
    text = chat.render_chat(template, msgs, add_generation_prompt=False, tools=[TYPED_TOOL])
    answer = text.rsplit("<|im_start|>assistant\n", 1)[1]
    assert chat.parse_tool_calls(answer, [TYPED_TOOL]) == [{"name": "book", "arguments": a} for a in calls]


def test_tool_calls_without_schema_and_unfinished():
    text = ("Sure.\n\n<tool_call>\n<function=f>\n<parameter=n>\n12\n</parameter>\n<parameter=s>\nhello\n</parameter>\n"
            "<parameter=j>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n"
            "<parameter=x>\n1\n")                                 # the second call was cut off: left out
    assert chat.parse_tool_calls(text) == [{"name": "f", "arguments": {"n": 12, "s": "hello", "j": {"a": [1, 2]}}}]
    typed = [{"name": "f", "parameters": {"properties": {"n": {"type": "string"}, "s": {"type": "integer"}}}}]
    assert chat.parse_tool_calls(text, typed)[0]["arguments"] == {"n": "12", "s": "hello", "j": {"a": [1, 2]}}
    assert chat.parse_tool_calls("no calls here") == []
    odd = [{"name": "f", "parameters": {"properties": {"n": {"type": ["integer", "null"]}, "s": {"type": "null"}}}},
           {"name": "g", "parameters": []}, {"function": "h"}]          # a union type, malformed schemas: no crash
    assert chat.parse_tool_calls(text, odd)[0]["arguments"] == {"n": 12, "s": "hello", "j": {"a": [1, 2]}}
    none = "<tool_call>\n<function=f>\n<parameter=s>\nNone\n</parameter>\n</function>\n</tool_call>"
    assert chat.parse_tool_calls(none, odd) == [{"name": "f", "arguments": {"s": None}}]


def test_json_reports_tool_calls(chat_ckpt):
    """chat_fields (the --json fields of a chat turn) parses the answer's calls, not the reasoning's text."""
    tok = chat_ckpt["tok"]
    out = ("I should call it.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
           "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call><|im_end|>")
    ids = tok.encode(out, add_special_tokens=False).ids
    stops = [tok.token_to_id("<|im_end|>")]
    fields = chat.chat_fields(tok, ids, stops, True, TOOLS)
    assert fields["reasoning"] == "I should call it."
    assert fields["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}]
    assert chat.chat_fields(tok, tok.encode("plain answer", add_special_tokens=False).ids, stops, False)["tool_calls"] == []


def test_prompts_file_chat_lines_equal_single_runs(chat_ckpt, capsys, tmp_path):
    """--prompts-file with a templated checkpoint: a "prompt" line is a chat user turn as --prompt is, a "messages"
    line the conversation as --messages + --prompt render it; each line's output == its single run's, and the chat
    fields (thinking, the stop at <|im_end|>) come with it."""
    p = chat_ckpt["path"]
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    lines = [{"prompt": "Hello there"}, {"messages": earlier + [{"role": "user", "content": "And now?"}]}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    base = ["--target", p, "--max-new-tokens", 6, "--json", "--dtype", "float32", "--no-think"]
    capsys.readouterr()
    assert generate.main([str(a) for a in [*base, "--prompts-file", tmp_path / "r.jsonl", "--concurrency", 2]]) == 0
    batch = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    singles = [run_json(capsys, *base, "--prompt", "Hello there"),
               run_json(capsys, *base, "--messages", tmp_path / "earlier.json", "--prompt", "And now?")]
    for got, want in zip(batch, singles):
        assert got["prompt_ids"] == want["prompt_ids"] and got["output_ids"] == want["output_ids"]
        assert got["chat"] and got["content"] == want["content"] and got["thinking"] is False


@pytest.mark.parametrize("thinking", [True, False])
def test_set_turns_render_as_the_zlab_script_renders_them(chat_ckpt, thinking):
    """prompts.conversation (tools/bench.py --dataset) == the z-lab benchmark's prompt: apply_chat_template(messages,
    tokenize=False, add_generation_prompt=True, enable_thinking) encoded without added special tokens, for an
    MT-Bench-like sample's first turn and its second, the reply (reasoning included, as decoded) fed back."""
    import prompts
    tpl, specials = chat.load_chat_template(chat_ckpt["path"])
    hf = chat_ckpt["hf_tok"]
    s = prompts.Sample(turns=["Compose a haiku about rain.", "Now rewrite it in French."])
    reply = "The user wants a haiku.\n</think>\n\nSoft rain on the roof"
    convs = [[{"role": "user", "content": s.turns[0]}],
             [{"role": "user", "content": s.turns[0]}, {"role": "assistant", "content": reply},
              {"role": "user", "content": s.turns[1]}]]
    for k, msgs in enumerate(convs):
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        want = hf.encode(text, add_special_tokens=False)
        assert prompts.conversation(s, k, [reply][:k], chat_ckpt["tok"], tpl, specials, thinking) == want
