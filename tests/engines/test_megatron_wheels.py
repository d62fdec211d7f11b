"""The wheels bench/gpu_megatron.sh carries are exactly what the Megatron path imports and the GPU machine lacks.

The path is the script's ``MEGATRON_PATH`` (the modules its GPU tests and benchmark run, with the
third-party modules they import inside functions). Imported here in a fresh interpreter, it needs:
every third-party module a loaded project module imports unconditionally (not under
``TYPE_CHECKING``, not under ``except ImportError``) and that was loaded, as its distribution, and
those distributions' requirements, transitively. The GPU machine has what
bench/gpu_machine_packages.txt lists (measured there): a requirement it meets at that version is
not walked further. What is left must be the names in bench/gpu_wheels.txt, the one list the
script installs and docs/megatron.md names.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_megatron.sh"
WHEEL_LIST = ROOT / "bench" / "gpu_wheels.txt"
MACHINE_PACKAGES = ROOT / "bench" / "gpu_machine_packages.txt"
PROJECT_PACKAGES = frozenset({"tasks", "tests", "bench"})
# Imported on the path but not installable here (the `megatron` extra needs Python >= 3.12): top-level
# module → distribution. Its own requirements are the GPU machine's (docs/megatron.md).
ONLY_ON_THE_GPU_PATH = {"megatron": "megatron-core"}
TARGET_ENVIRONMENT = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
PROBE = """
import importlib, json, sys
missing = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        missing[name] = error.name
files = sorted({getattr(module, "__file__", None) or "" for name, module in list(sys.modules.items())
                if name.split(".")[0] in {"tasks", "tests", "bench"}} - {""})
print(json.dumps({"loaded": sorted({name.split(".")[0] for name in sys.modules}), "files": files, "missing": missing}))
"""


def megatron_path() -> list[str]:
    """The script's ``MEGATRON_PATH``, as bash reads it."""
    listing = 'eval "$(sed -n "/^MEGATRON_PATH=(/,/)/p" "$1")"; printf "%s\\n" "${MEGATRON_PATH[@]}"'
    done = subprocess.run(["bash", "-c", listing, "bash", str(SCRIPT)], check=True, capture_output=True, text=True)
    return done.stdout.split()


def _pins(path: Path) -> dict[str, str]:
    """A ``name==version`` file (comments after ``#``) as canonical name → version."""
    pins = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(name): version for name, _, version in (pin.partition("==") for pin in pins if pin)}


def listed_wheels() -> dict[str, str]:
    """bench/gpu_wheels.txt as canonical name → pinned version."""
    return _pins(WHEEL_LIST)


def _unconditional_imports(source: str) -> set[str]:
    """Top-level names ``source`` imports outside ``if TYPE_CHECKING`` and outside ``try/except ImportError``."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Try) and any(h.type and "ImportError" in ast.unparse(h.type) for h in node.handlers):
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return names


def _requirements(distribution: str) -> list[Requirement]:
    """What ``distribution`` (as installed here) requires on the GPU machine's Python, extras left out."""
    try:
        required = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []  # megatron-core: not installable here
    return [req for req in map(Requirement, required) if req.marker is None or req.marker.evaluate(TARGET_ENVIRONMENT)]


def lacking_on_the_machine(roots: set[str], machine: dict[str, str]) -> set[str]:
    """``roots`` the machine lacks, and what those require that it lacks or has at a version outside the range."""
    lacking: set[str] = set()
    todo = [Requirement(name) for name in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in lacking or (name in machine and req.specifier.contains(machine[name], prereleases=True)):
            continue
        lacking.add(name)
        todo.extend(_requirements(name))
    return lacking


def path_distributions() -> set[str]:
    """Distributions whose modules the Megatron path imports itself (its requirements not included)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *megatron_path()], check=False, cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    missing = {module: (name or "").split(".")[0] for module, name in probe["missing"].items()}
    assert set(missing.values()) <= set(ONLY_ON_THE_GPU_PATH), f"the path does not import here: {missing}"
    imported = set().union(*(_unconditional_imports(Path(file).read_text()) for file in probe["files"]))
    imported |= {name.split(".")[0] for name in megatron_path()}
    used = imported & (set(probe["loaded"]) | set(missing.values())) - PROJECT_PACKAGES - set(sys.stdlib_module_names)
    owners = importlib.metadata.packages_distributions()
    return {ONLY_ON_THE_GPU_PATH[name] if name in missing.values() else owners[name][0] for name in used}


def test_the_wheel_list_is_what_the_megatron_path_imports_and_the_gpu_machine_lacks() -> None:
    needed = lacking_on_the_machine(path_distributions(), _pins(MACHINE_PACKAGES))
    listed = set(listed_wheels())
    assert needed == listed, (
        f"bench/gpu_wheels.txt lacks {sorted(needed - listed)} and lists {sorted(listed - needed)}, "
        "which the Megatron path does not import or the GPU machine has"
    )


def test_the_script_installs_the_listed_wheels_and_the_doc_names_the_list() -> None:
    script, doc = SCRIPT.read_text(), (ROOT / "docs" / "megatron.md").read_text()
    assert "bench/gpu_wheels.txt" in script and "bench/gpu_wheels.txt" in doc
    assert "-r bench/gpu_wheels.txt" in doc, "the doc's download command reads the list"
    assert not [name for name in listed_wheels() if f"`{name}`" in doc], "the doc names the file, not the wheels"
    assert all(listed_wheels().values()), "every wheel is pinned (name==version)"
