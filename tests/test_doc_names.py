"""The design documents name the code as it is: every class, function, method and constant they cite in backticks
exists in the package (as tests/test_imports.py keeps the layers they describe).

Read from the source with `ast`. What counts as a cited name (anything else in backticks, a flag, a file, a
command, a drafter's name, is left alone):

- `Class` (CamelCase): a class, function or name defined or imported somewhere in the package;
- `Class.member`: a member of that class (a method, a class attribute or field, or a `self.member` it assigns) or of
  one of its bases in the package;
- `module.name`, `folder/module.name`: a name defined (or a submodule) in that module of the package;
- `snake_case_name`, `_private`, `CONSTANT_NAME`: an identifier or a string the package uses (an attribute, a
  keyword, an environment variable's name);

a trailing call (`forward(reach=)`) or value (`SPECDRAFT_PREPACK=0`) is dropped first, and Python's builtins
(`None`) are left alone.
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import specdraft

ROOT = Path(specdraft.__file__).parent
DOCS = Path(__file__).resolve().parents[1] / "docs"
CHECKED = ["architecture.md", "design.md"]
# Top-level names of other libraries that the documents cite (`torch.multinomial`, `nn.Linear`).
FOREIGN = {"torch", "nn", "F", "np", "numpy", "ray", "transformers", "llguidance", "gguf", "triton"}
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
CODE_NAME = re.compile(rf"^{IDENTIFIER}(?:[./]{IDENTIFIER})*$")
FILE_SUFFIXES = ("py", "c", "h", "md", "html", "json", "jsonl", "png", "gguf", "safetensors")


@dataclass
class Package:
    """What the package defines, read from its source."""

    classes: dict[str, tuple[set[str], list[str]]] = field(default_factory=dict)  # name -> (members, bases)
    modules: dict[str, set[str]] = field(default_factory=dict)  # "engine", "models.loading" -> top-level names
    defined: set[str] = field(default_factory=set)  # every class, function and assigned or imported name
    used: set[str] = field(default_factory=set)  # every identifier and identifier-like string anywhere

    def has_member(self, owner: str, member: str, seen: frozenset = frozenset()) -> bool:
        members, bases = self.classes.get(owner, (set(), []))
        return member in members or any(self.has_member(base, member, seen | {owner})
                                        for base in bases if base not in seen)


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _names(targets: list[ast.AST]) -> set[str]:
    found = set()
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                found.add(node.id)
    return found


def _class_members(node: ast.ClassDef) -> set[str]:
    members = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(item.name)
        members |= _names(_targets(item))
    for sub in ast.walk(node):  # self.x = ... in any method
        for target in _targets(sub):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                members.add(target.attr)
    return members


def read_package() -> Package:
    package = Package()
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text())
        top = package.modules.setdefault(module, set())
        for item in tree.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(item.name)
            elif isinstance(item, (ast.Import, ast.ImportFrom)):
                top.update((alias.asname or alias.name).split(".")[0] for alias in item.names)
            top |= _names(_targets(item))
        if "." in module:  # a submodule is a name of its package
            parent, _, child = module.rpartition(".")
            package.modules.setdefault(parent, set()).add(child)
        elif module:
            package.modules.setdefault("", set()).add(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases]
                members, known = package.classes.get(node.name, (set(), []))
                package.classes[node.name] = (members | _class_members(node), known + bases)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                package.defined.add(node.name)
                package.used.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                package.defined.update((alias.asname or alias.name).split(".")[-1] for alias in node.names)
            elif isinstance(node, ast.Name):
                package.used.add(node.id)
            elif isinstance(node, ast.Attribute):
                package.used.add(node.attr)
            elif isinstance(node, ast.arg):
                package.used.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                package.used.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                package.used.update(re.findall(IDENTIFIER, node.value))
            package.defined |= _names(_targets(node))
    package.used |= package.defined
    return package


def cited(text: str) -> list[str]:
    """The code names cited in backticks in `text`, each once, with calls and values dropped."""
    names = []
    for quoted in re.findall(r"`([^`\n]+)`", text):
        name = re.sub(r"\(.*\)$", "", quoted.strip()).split("=")[0]
        if not CODE_NAME.match(name) or name.rsplit(".", 1)[-1] in FILE_SUFFIXES or hasattr(builtins, name):
            continue
        if "." in name or "/" in name or "_" in name or re.match(r"^[A-Z][a-z0-9]+[A-Z]", name):
            names.append(name)
        elif re.match(r"^[A-Z][a-z]+$", name):  # `Draft`, `Verdict`, `Scale`: one capitalised word
            names.append(name)
    return list(dict.fromkeys(names))


def missing(name: str, package: Package) -> bool:
    """Whether `name` (as `cited` returns it) names nothing in the package."""
    parts = name.replace("/", ".").split(".")
    if parts[0] in FOREIGN:
        return False
    if len(parts) == 1:
        return name not in (package.defined if name[0].isupper() and not name.isupper() else package.used)
    owner, member = ".".join(parts[:-1]), parts[-1]
    if owner in package.modules:
        return member not in package.modules[owner]
    if parts[-2] in package.classes:
        return not package.has_member(parts[-2], member)
    return member not in package.used  # `ctx.tree_branch`, `usage....cached_tokens`: an attribute or a field


@pytest.fixture(scope="module")
def package() -> Package:
    return read_package()


@pytest.mark.parametrize("document", CHECKED)
def test_names_cited_in_the_design_documents_exist(document, package):
    names = cited((DOCS / document).read_text())
    assert len(names) > 10, f"{document} cites almost no code: has the pattern stopped matching?"
    stale = [name for name in names if missing(name, package)]
    assert not stale, f"{document} cites names the package does not have (renamed? removed?): {stale}"


def test_a_renamed_name_is_caught(package):
    assert cited("`SpeculativeDecoder._steps` over `_Run`, `CausalLM.keep`, `policy.py`, `--k`, `ar`") == [
        "SpeculativeDecoder._steps", "_Run", "CausalLM.keep"]
    assert missing("_Run", package) and missing("CausalLM.no_such_method", package)
    assert missing("engine.no_such_function", package) and missing("NoSuchClass", package)
    assert not missing("CausalLM.keep", package) and not missing("goodput.choose_batch_k", package)
