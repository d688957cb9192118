"""The package's shape, checked from its source: data flows one way between top-level packages,
only tiers/ (and placement/, which defines and prices the kinds) names a tier kind, and no module
grows past 600 lines. Parsed with ast from the source tree, so a lazy import inside a function
counts as much as one at the top."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tierstate

PACKAGE = Path(tierstate.__file__).resolve().parent
MAX_LINES = 600
# placement/ defines TierKind and prices each kind (layout ranges, planner costs): arithmetic over
# the kinds, where the kinds are the subject; every other package asks a tier what it does.
KIND_NAMERS = {"tiers", "placement"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _unit(path: Path) -> str | None:
    """The top-level package or module ``path`` belongs to (None for the package's own __init__)."""
    rel = path.relative_to(PACKAGE)
    if rel.parts == ("__init__.py",):
        return None
    return rel.parts[0].removesuffix(".py")


def _imported_units(path: Path) -> set[str]:
    """Top-level units of tierstate that ``path`` imports, absolute or relative, anywhere in it."""
    rel = path.relative_to(PACKAGE)
    package_parts = list(rel.parts[:-1])  # the package the module lives in, inside tierstate
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                targets = [node.module or ""]
                if node.module == "tierstate":
                    targets = [f"tierstate.{a.name}" for a in node.names]
            else:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                if node.level - 1 > len(package_parts):
                    continue
                mod = ".".join(["tierstate", *base, *(node.module.split(".") if node.module else [])])
                targets = [mod] if node.module or base else [f"tierstate.{a.name}" for a in node.names]
        for t in targets:
            parts = t.split(".")
            if parts[0] == "tierstate" and len(parts) > 1:
                out.add(parts[1])
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _modules():
        unit = _unit(path)
        if unit is None:
            continue
        graph.setdefault(unit, set()).update(u for u in _imported_units(path) if u != unit)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        path.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_no_import_cycle_between_top_level_packages():
    cycle = _cycle(_graph())
    assert cycle is None, f"import cycle between tierstate's top-level packages: {' -> '.join(cycle)}"


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a made-up graph with a cycle is reported, one without is not."""
    assert _cycle({"optim": {"pipeline"}, "pipeline": {"tiers"}, "tiers": {"optim"}}) == \
        ["optim", "pipeline", "tiers", "optim"]
    assert _cycle({"optim": {"pipeline", "tiers"}, "pipeline": {"tiers"}, "tiers": set()}) is None


def test_the_layers_run_one_way():
    """What DESIGN.md's picture says, edge by edge, for the layers it names."""
    graph = _graph()
    assert "optim" not in graph["checkpoint"], "checkpoint/ reads state through tiers.StateStore, not optim"
    assert "optim" not in graph["pipeline"] and "checkpoint" not in graph["pipeline"]
    assert not graph["tiers"] & {"optim", "pipeline", "checkpoint"}
    assert not graph["placement"] & {"optim", "pipeline", "tiers", "checkpoint"}, "placement is arithmetic below"
    assert not graph["kernels"] & {"optim", "pipeline", "tiers", "rules"}


def test_placement_imports_no_package_that_imports_it():
    """Data flows one way: placement is below optim, tiers and pipeline (which import it)."""
    graph = _graph()
    users = {unit for unit, deps in graph.items() if "placement" in deps}
    assert {"optim", "tiers", "pipeline"} <= users  # the scan sees real imports (checkpoint goes through tiers)
    assert not graph["placement"] & users, f"placement imports {sorted(graph['placement'] & users)}"


def _kind_names(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each place naming a tier kind: ``TierKind.X``, or the kind enum imported."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("DEVICE", "HOST", "NVME", "DISK"):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
            if name in ("TierKind", "Tier"):
                found.append((node.lineno, f"{name}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and any(a.name == "TierKind" for a in node.names):
            found.append((node.lineno, "import TierKind"))
    return found


def test_only_tiers_names_a_tier_kind():
    offenders = [f"{p.relative_to(PACKAGE)}:{line}: {what}" for p in _modules()
                 if _unit(p) not in KIND_NAMERS for line, what in _kind_names(p)]
    assert not offenders, ("outside tiers/ a tier is asked what it does (does_io, wait_phase, on_device, "
                           "host_views), never which kind it is:\n" + "\n".join(offenders))


def test_kind_finder_sees_a_kind(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from x import TierKind\nif tier is TierKind.NVME:\n    pass\n")
    assert [w for _, w in _kind_names(probe)] == ["import TierKind", "TierKind.NVME"]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {n} lines; split it by role (at most {MAX_LINES})"


def _repo_root() -> Path | None:
    """The checkout the suite runs from (the docs live there, not in the installed package)."""
    here = Path(__file__).resolve()
    root = here.parents[2]
    return root if (root / "docs" / "architecture.md").is_file() else None


def test_architecture_note_index_points_at_each_note():
    """docs/architecture.md's [Note: ...] index names the file each note lives in, and lists every note."""
    root = _repo_root()
    if root is None:
        pytest.skip("not run from a checkout (docs/ absent)")
    doc = (root / "docs" / "architecture.md").read_text()
    index = doc[doc.index("## The `[Note: ...]` index"):]
    rows = [line.split("|")[1:3] for line in index.splitlines() if line.startswith("| ") and "`" in line]
    listed = set()
    for title, where in rows:
        title, path = title.strip(), root / where.strip().strip("`")
        assert path.is_file(), f"docs/architecture.md: {path} (for [Note: {title}]) does not exist"
        assert f"[Note: {title}]" in path.read_text(), f"docs/architecture.md: [Note: {title}] is not in {path}"
        listed.add(title)
    import re

    defined = set()
    for path in [*(root / "src").rglob("*.py"), *(root / "csrc").rglob("*.[ch]*")]:
        for line in path.read_text(errors="replace").splitlines():
            m = re.match(r"^\s*(?:#|//)?\s*\[Note: ([^\]]+)\]\s*$", line)
            if m:
                defined.add(m.group(1))
    assert defined - listed == set(), f"notes missing from docs/architecture.md's index: {sorted(defined - listed)}"
