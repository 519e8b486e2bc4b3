"""Chat: the checkpoint's own Jinja chat template rendered the way transformers' apply_chat_template renders it,
the thinking split of generated text, and Qwen3.5's tool calls parsed back into JSON.

    load_chat_template(path)       -> (template, special tokens) of a checkpoint folder
    render_chat(template, msgs)    -> the prompt text
    chat_prompt(...)               the conversation of the command line (--messages, --system, --prompt, --image)
    split_thinking / chat_display  generated text -> (reasoning, answer) / what the terminal shows
    parse_tool_calls(text, tools)  <tool_call> blocks -> [{"name", "arguments"}]

Stop tokens and the template's format: docs/qwen35.md#tokenizer-chat-template-and-stop-tokens.
"""
from __future__ import annotations

import json
import os
import re
import time

from checkpoint import CheckpointError, read_json
from dflash import GenerationError

# Qwen3.5's template gives, for one user turn with thinking on (the default):
#     <|im_start|>system\n{system}<|im_end|>\n          (only with a system prompt)
#     <|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n<think>\n
# and with enable_thinking=False the prompt ends with an empty reasoning block: ...assistant\n<think>\n\n</think>\n\n
# The model then writes its reasoning, "</think>", the answer, and <|im_end|>. We render the template itself
# (jinja2 comes with torch) rather than a hand-written copy of it, so a fine-tune that edits its template is
# served as its authors meant; tests/test_chat.py checks the result against transformers with Qwen3.5's template.
THINK_END = "</think>"
CHAT_STOPS = ("<|im_end|>", "<|endoftext|>")


def with_chat_stops(tokenizer, stops: list) -> list:
    """`stops` plus the ids of CHAT_STOPS the tokenizer has: a turn ends at <|im_end|> even when the checkpoint's
    configs name only <|endoftext|>."""
    return stops + [i for i in map(tokenizer.token_to_id, CHAT_STOPS) if i is not None and i not in stops]


def load_chat_template(path: str):
    """-> (template text, special tokens the template may name) from chat_template.jinja (preferred, as in
    transformers 5) or tokenizer_config.json's chat_template; (None, {}) when the checkpoint ships none."""
    cfg_file = os.path.join(path, "tokenizer_config.json")
    cfg = read_json(cfg_file) if os.path.exists(cfg_file) else {}
    specials = {k: (v["content"] if isinstance(v, dict) else v) for k, v in cfg.items()
                if k in ("bos_token", "eos_token", "pad_token", "unk_token") and isinstance(v, (str, dict))}
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as fh:
            return fh.read(), specials
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):      # named templates: [{"name": "default", "template": ...}, ...]
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if tpl is not None and not isinstance(tpl, str):
        raise CheckpointError(f"{cfg_file}: chat_template is a {type(tpl).__name__}, not a string; re-download the checkpoint")
    return tpl, specials


def render_chat(template: str, messages: list, enable_thinking: bool = True, add_generation_prompt: bool = True,
                special_tokens: dict | None = None, tools: list | None = None) -> str:
    """messages [{role, content}, ...] -> the prompt text, as transformers' apply_chat_template(tokenize=False)
    renders it: a sandboxed environment with trim_blocks and lstrip_blocks, a tojson that leaves non-ASCII as is,
    and raise_exception. tools: JSON tool schemas (Qwen3.5's template lists them in a "# Tools" system block).
    A conversation the template refuses is a GenerationError carrying its message."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise CheckpointError(f"the checkpoint's chat template does not parse ({e.message}, line {e.lineno}); "
                                "fix chat_template.jinja or pass --no-chat") from None
    try:
        return compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               enable_thinking=enable_thinking, **(special_tokens or {}))
    except jinja2.exceptions.TemplateError as e:
        raise GenerationError(f"the chat template refused the conversation: {e.message}") from None


def read_json_arg(flag: str, f: str):
    """The JSON value in the file given to `flag`, or a one-line GenerationError."""
    try:
        with open(f, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as e:
        raise GenerationError(f"{flag} {f} cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GenerationError(f"{flag} {f} is not valid JSON ({e})") from None


def read_tools(f: str) -> list:
    """--tools FILE: a JSON list of tool schemas, each an object: {"type": "function", "function": {"name": ...,
    "description": ..., "parameters": {JSON schema}}} (the form transformers and OpenAI-style APIs use), or
    the bare function object. The template prints them as given."""
    tools = read_json_arg("--tools", f)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise GenerationError(f"--tools {f} must hold a JSON list of tool objects, e.g. "
                                     '[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]')
    return tools


def read_messages(f: str) -> list:
    """--messages FILE: a JSON list of {"role": ..., "content": ...} objects."""
    msgs = read_json_arg("--messages", f)
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
        raise GenerationError(f"--messages {f} must hold a JSON list of objects with a 'role' string, "
                                     'e.g. [{"role": "user", "content": "hi"}]')
    return msgs


def chat_prompt(template: str, specials: dict, *, messages_file: str | None = None, system: str | None = None,
                prompt: str | None = None, n_images: int = 0, thinking: bool = True, tools: list | None = None) -> str:
    """The command line's conversation, rendered: the turns of --messages, a --system message first, and --prompt
    as a new user turn that opens with the images not already placed in earlier turns."""
    messages = read_messages(messages_file) if messages_file else []
    if system is not None:
        if messages and messages[0].get("role") == "system":
            raise GenerationError("--system was given and --messages already starts with a system message; keep one")
        messages = [{"role": "system", "content": system}] + messages
    if prompt is not None:      # images first, then the text, as Qwen3.5's processors place them
        # --image files fill the image items of --messages first, in order; the rest open this turn
        placed = sum(1 for m in messages if isinstance(m.get("content"), list)
                     for item in m["content"] if isinstance(item, dict) and (item.get("type") == "image" or "image" in item))
        content = [{"type": "image"} for _ in range(n_images - placed)] + [{"type": "text", "text": prompt}]
        messages.append({"role": "user", "content": content if len(content) > 1 else prompt})
    return render_chat(template, messages, enable_thinking=thinking, special_tokens=specials, tools=tools)


def split_thinking(text: str, thinking: bool) -> tuple:
    """Generated chat text -> (reasoning, answer). With thinking on, the prompt ended inside "<think>\n", so
    everything before the first "</think>" is reasoning; an unfinished block is all reasoning, no answer."""
    if not thinking:
        return "", text
    if THINK_END not in text:
        return text.strip("\n"), ""
    reasoning, answer = text.split(THINK_END, 1)
    return reasoning.strip("\n"), answer.lstrip("\n")


def chat_display(text: str) -> str:
    """What the terminal shows for generated text when thinking is on: the reasoning under a [thinking] line,
    the answer under an [answer] line. The display only ever grows as text grows (the stream prints its tail):
    a text ending in a prefix of "</think>" is held back until the tag is complete or ruled out."""
    if THINK_END in text:
        reasoning, answer = text.split(THINK_END, 1)
        return "[thinking]\n" + reasoning + "\n[answer]\n" + answer.lstrip("\n")
    for k in range(len(THINK_END) - 1, 0, -1):
        if text.endswith(THINK_END[:k]):
            text = text[:-k]
            break
    return "[thinking]\n" + text


def chat_fields(tokenizer, output_ids: list, stops: list, thinking: bool, tools: list | None = None) -> dict:
    """The --json fields of a chat turn: its text split into reasoning and answer (stop tokens left out), and
    the complete tool calls in the answer (parse_tool_calls)."""
    text = tokenizer.decode([i for i in output_ids if i not in stops], skip_special_tokens=False)
    reasoning, answer = split_thinking(text, thinking)
    return {"chat": True, "thinking": thinking, "reasoning": reasoning, "content": answer,
            "tool_calls": parse_tool_calls(answer, tools)}


# Qwen3.5's tool-call format, as its template writes an assistant's calls (and asks the model to):
#     <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>
# VALUE is written with Jinja's `string` filter, or as JSON for objects and lists, so it carries no type of
# its own: the tool's JSON schema (from --tools) says how to read it back.
TOOL_CALL_RE = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n(.*?)</function>\s*</tool_call>", re.S)
PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>", re.S)


def _tool_value(raw: str, kind):
    """A parameter's text -> its value, read as the schema's JSON type `kind` (None: unknown). Text that does
    not parse as that type is kept as the string it is, for the caller to validate, never guessed. A union
    type (a list, e.g. ["string", "null"]) counts as unknown."""
    if not isinstance(kind, str):
        kind = None
    if kind == "null" and raw.strip() in ("None", "null"):     # the template writes Python's None as "None"
        return None
    if kind == "string":
        return raw
    if kind == "boolean":
        return {"true": True, "false": False}.get(raw.strip().lower(), raw)
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
    if kind in ok:
        return value if ok[kind](value) else raw
    return value if not isinstance(value, str) else raw        # no schema: JSON when it is JSON


def parse_tool_calls(text: str, tools: list | None = None) -> list:
    """The complete tool calls in generated text -> [{"name": ..., "arguments": {...}}] in order (an unfinished
    call at the end of the text is left out). Argument types follow the --tools schemas where they name the
    parameter (see _tool_value)."""
    schemas = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            props = props if isinstance(props, dict) else {}
            schemas[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    calls = []
    for name, body in TOOL_CALL_RE.findall(text):
        name = name.strip()
        types = schemas.get(name, {})
        pairs = ((key.strip(), raw) for key, raw in PARAMETER_RE.findall(body))
        calls.append({"name": name, "arguments": {key: _tool_value(raw, types.get(key)) for key, raw in pairs}})
    return calls
