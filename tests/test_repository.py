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
    """The method's files read as plain PyTorch: no CPU-specific speed path (those live in speed/), functions of about
    60 lines at most, the reference loop (dflash.generate) of about 80 and dflash.py of about 300 with the checks it
    needs, and no class over 200 lines in the reference loop's file or the engine's (a longer class does two jobs)."""
    for name in CORE + ("engine.py",):
        with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
            src = fh.read()
        assert not re.search(r"onednn|mkldnn|_mkl_", src, re.IGNORECASE), f"{name}: CPU-specific speed paths belong in speed/"
        if name == "dflash.py":
            assert src.count("\n") <= 300, f"dflash.py is {src.count(chr(10))} lines (keep the method's page to about 300)"
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                most = 80 if (name, node.name) == ("dflash.py", "generate") else 60
                assert length <= most, f"{name}: {node.name} is {length} lines (keep it to about {most})"
            if isinstance(node, ast.ClassDef) and name in ("dflash.py", "engine.py"):
                length = node.end_lineno - node.lineno + 1
                assert length <= 200, f"{name}: class {node.name} is {length} lines (split classes over 200 lines)"


def python_files() -> list:
    """The tracked modules outside tests/ and docs/: top-level files, tools/ and speed/ (packages' __init__ aside)."""
    return sorted(n for n, _ in tracked_text_files()
                  if n.endswith(".py") and not n.startswith(("tests/", "docs/")) and not n.endswith("__init__.py"))


def module_of(path: str) -> str:
    """tools/bench.py -> tools.bench; model.py -> model."""
    return path[:-3].replace("/", ".")


def imports_of(path: str) -> set:
    """The repository modules file `path` imports, anywhere in it (function bodies included), as dotted names:
    `from speed import packed` and `import speed.packed` are both speed.packed."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            out |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return out & {module_of(p) for p in python_files()}


def import_graph() -> dict:
    return {module_of(p): imports_of(p) for p in python_files()}


def upward_imports(graph: dict) -> list:
    """Imports of a tool by a module outside tools/, and of the command line (generate) by anything."""
    return [f"{m} imports {d}" for m, deps in graph.items() for d in deps
            if (d.startswith("tools.") and not m.startswith("tools.")) or d == "generate"]


def import_circle(graph: dict) -> list:
    """The first circle of imports found in `graph` ({module: imported modules}), as a path; [] when none."""
    state, found = {}, []

    def visit(m, path):
        if found or state.get(m) == "done":
            return
        if state.get(m) == "open":
            found.extend(path[path.index(m):] + [m])
            return
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        state[m] = "done"
    for m in sorted(graph):
        visit(m, [])
    return found


def test_layout_imports_point_down_and_never_circle():
    """The layout shows the architecture: the method and its programs at the top level, tools/ (benchmarks,
    tables, training, prompts) above them, speed/ (machine-specific paths, chosen by flags) beside them. So no
    top-level or speed/ module imports a tool, nothing imports the command line (generate.py) as a library, and
    the imports (function bodies included) form no circle."""
    graph = import_graph()
    assert "tools.bench" in graph and "speed.packed" in graph["options"]      # (the graph sees both folders)
    assert not upward_imports(graph), "\n".join(upward_imports(graph))
    assert not import_circle(graph), " -> ".join(import_circle(graph))


def test_the_layout_checks_can_fail():
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert upward_imports({"model": {"tools.prompts"}, "check": {"generate"}, "tools.bench": {"tools.tables"}}) == \
        ["model imports tools.prompts", "check imports generate"]


def test_optional_modules_are_imported_only_where_selected():
    """speed/packed.py, speed/flex.py and speed/cppwrapper.py can be deleted with their flags: the method's files
    never import them, nor does any module they import (policy.py, sampling.py, noise.py, compiling.py, ...),
    followed to the end."""
    graph = import_graph()
    todo = [n[:-3] for n in CORE + ("engine.py", "checkpoint.py", "chat.py", "vision.py")]
    seen = set(todo)
    while todo:
        name = todo.pop()
        optional = {d for d in graph[name] if d.startswith("speed")}
        assert not optional, f"{name}.py imports {optional}"
        for m in graph[name] - seen:
            seen.add(m)
            todo.append(m)
    assert {"policy", "sampling", "noise", "compiling"} <= seen


def test_files_table_names_every_file():
    """The README's Files table (its first column, `name.py` or `folder/name.py`) names every tracked module
    outside tests/ and docs/, and no file that is not there."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    section = readme.split("\n## Files", 1)
    assert len(section) == 2, "README.md has no '## Files' section"
    table = section[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w/]+\.py)`", table))
    files = set(python_files())
    assert files <= named and not {n for n in named if n.endswith(".py") and "/" not in n} - files, \
        f"in the clone, not in the table: {sorted(files - named)}"


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
