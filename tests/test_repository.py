"""The repository stands alone and stays readable: no references to texts a reader who clones it does not have,
every docs/ link points at a real section, and the three core files stay small, plain PyTorch."""
import ast
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("model.py", "kernels.py", "dflash.py")


def tracked_text_files() -> list:
    """Every tracked file that is text (tokenizer.json is the BPE vocabulary: arbitrary source text, skipped)."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    out = []
    for name in names:
        if name.endswith(("tokenizer.json", ".safetensors")):
            continue
        try:
            with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
                out.append((name, fh.read()))
        except (UnicodeDecodeError, FileNotFoundError):
            continue
    return out


# A reference to a private text, or to this project's own tracker. Public threads are cited as owner/repo#N.
# (Written with character classes and split literals so that this file passes its own check.)
FORBIDDEN = re.compile(r"\.\./s[h]ared|qwen35-s[p]ec|dflash-n[o]tes|\b(issue|issues|PR|pull request)\s+#?\d+|\b(spec|notes)\s+(section\s+)?\d",
                       re.IGNORECASE)


def test_no_reference_to_texts_outside_the_repository():
    bad = []
    for name, text in tracked_text_files():
        for i, line in enumerate(text.splitlines(), 1):
            m = FORBIDDEN.search(line)
            if m:
                bad.append(f"{name}:{i}: {m.group(0)!r}")
    assert not bad, "cite docs/ sections, papers or owner/repo#N instead:\n" + "\n".join(bad)


def test_the_check_above_can_fail():
    for line in ("see ../" "shared/notes", "qwen35-" "spec.md", "fixed in issue" " 4", "issue" " #12", "(spec" " 4.6)",
                 "notes" " 3", "PR" " #169", "spec section" " 10"):
        assert FORBIDDEN.search(line), line
    for line in ("z-lab/dflash#66", "vllm-project/vllm#40727", "docs/method.md#sampling", "the spec says"):
        assert not FORBIDDEN.search(line), line


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_links_point_at_sections():
    anchors = {}
    for doc in [d for d in os.listdir(os.path.join(ROOT, "docs")) if d.endswith(".md")]:    # docs/llama-cpp/: a script
        with open(os.path.join(ROOT, "docs", doc), encoding="utf-8") as fh:
            anchors[doc] = {anchor(line.lstrip("#")) for line in fh if line.startswith("#")}
    bad = []
    for name, text in tracked_text_files():
        for doc, frag in re.findall(r"docs/(\w+\.md)#([\w\-]+)", text):
            if doc not in anchors or frag not in anchors[doc]:
                bad.append(f"{name}: docs/{doc}#{frag}")
    assert not bad, "links to missing sections:\n" + "\n".join(bad)


def test_core_files_are_small_and_plain():
    total = 0
    for name in CORE:
        with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
            src = fh.read()
        total += src.count("\n")
        assert not re.search(r"onednn|mkldnn|_mkl_", src, re.IGNORECASE), f"{name}: CPU-specific speed paths belong in packed.py"
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{name}: {node.name} is {length} lines (keep functions to about 60)"
            if isinstance(node, ast.ClassDef) and name == "dflash.py":
                length = node.end_lineno - node.lineno + 1
                assert length <= 200, f"{name}: class {node.name} is {length} lines (split classes over 200 lines)"
    # About 1,300 lines held the dense target and the original drafter; the mixture-of-experts block, the sliding
    # and DFlash2 drafter variants and the general accept rule brought it to about 1,520; plain steps between
    # rounds (adaptive speculation) to about 1,580; looks, and the next-token rows the MTP head reads (the head
    # itself lives in mtp.py), to about 1,620. One engine for one request and for many (engine.Engine: N slots,
    # admissions as slots free, each row's pending features; it replaced the single-request engine and
    # batching.py's 955 lines) brought it to about 1,870. The policy of adaptive speculation lives in policy.py,
    # the sampling rules and the noise keyed by position in sampling.py and noise.py; how the steps compile
    # (inductor options, the checks dynamo skips, model_state) in compiling.py. The drafter's attention over the
    # cache where it lies (model.attention_two) and cache writes inductor keeps in place: about 1,910. The
    # commit inside the verify step, and a layer's products of one input run as one (model.linears): about 1,950.
    # Grouped query heads folded into query rows for SDPA on a GPU (model.folded_attention) and the compiled block
    # rule's triangular solve in elementwise ops (kernels.unit_lower_solve): about 1,990.
    assert total <= 1990, f"{' + '.join(CORE)} = {total} lines (keep the core to about 1,990)"


def flat_modules() -> set:
    """The flat files' module names (the top-level .py files)."""
    return {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}


def imports_of(name: str) -> set:
    """The modules file `name` imports, anywhere in it (function bodies included)."""
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return imported | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_optional_modules_are_imported_only_where_selected():
    """packed.py, flex.py and cppwrapper.py can be deleted with their flags: the core never imports them, nor does
    any flat file the core imports (policy.py, sampling.py, noise.py, compiling.py, ...), followed to the end."""
    optional, flat = {"packed", "flex", "cppwrapper"}, flat_modules()
    todo = [n[:-3] for n in CORE + ("checkpoint.py", "chat.py", "train.py", "vision.py")]
    seen = set(todo)
    while todo:
        name = todo.pop()
        imported = imports_of(name + ".py")
        assert not imported & optional, f"{name}.py imports {imported & optional}"
        for m in (imported & flat) - seen:
            seen.add(m)
            todo.append(m)
    assert {"policy", "sampling", "noise", "compiling"} <= seen


def test_files_table_names_every_flat_file():
    """The README's Files table (its first column, `name.py`) names every tracked top-level .py file, and no file
    that is not there (batching.py and adaptive.py went into engine.Engine and policy.py)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    section = readme.split("\n## Files", 1)
    assert len(section) == 2, "README.md has no '## Files' section"
    table = section[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `(\w+)\.py`", table, re.MULTILINE))
    flat = {n[:-3] for n, _ in tracked_text_files() if "/" not in n and n.endswith(".py")}
    assert named == flat, f"in the table, not in the clone: {sorted(named - flat)}; in the clone, not in the table: {sorted(flat - named)}"
    assert {"batching", "adaptive"}.isdisjoint(flat) and "policy" in flat


def test_installing_claims_no_module_names():
    """`pip install -e .` brings the dependencies and installs none of the flat files as a top-level module
    (their names, `model`, `kernels`, `dflash`, `generate`, are generic: they would shadow the z-lab `dflash`
    package and Hugging Face's `kernels` in every script of the environment). The scripts and tests run from
    the clone. Checked in the declared package and in the environment, from outside the clone."""
    import sys
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        setuptools_cfg = tomllib.load(fh)["tool"]["setuptools"]
    assert setuptools_cfg.get("py-modules") == [] and setuptools_cfg.get("packages") == []
    flat = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
    probe = ("import importlib.util, os, sys\n"
             f"for name in {flat!r}:\n"
             "    spec = importlib.util.find_spec(name)\n"
             f"    if spec is not None and spec.origin and os.path.dirname(spec.origin) == {ROOT!r}:\n"
             "        print(name)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr


def test_shipped_code_never_imports_the_tests():
    """The flat files run without tests/ on the path: no `helpers` import, no sys.path entry for tests/."""
    bad = []
    for name, text in tracked_text_files():
        if "/" in name or not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(text)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                   [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{name}:{node.lineno}: imports {m}" for m in mods if m.split(".")[0] in ("helpers", "tests", "conftest")]
        bad += [f"{name}: puts tests/ on sys.path" for line in text.splitlines() if "sys.path" in line and "tests" in line]
    assert not bad, "\n".join(bad)
