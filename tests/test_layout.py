"""The package's rooms: no import cycle, each module holds what its name says (read from the source)."""

import ast
import importlib
import io
import re
import tokenize
from dataclasses import fields
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "raysweep"


def _name(path: Path) -> str:
    """A module's dotted name inside the package: `sweep`, `worker.step`, `worker` (its __init__)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if _name(p)}


def _imports(path: Path) -> set[str]:
    """raysweep modules a file imports, at any depth (function-level imports count: they run too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "raysweep":
            base = node.module.partition(".")[2]
            for alias in node.names:  # `from raysweep.worker import step` imports a module; `... import X` its module
                sub = f"{base}.{alias.name}" if base else alias.name
                found.add(sub if sub in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(a.name.partition(".")[2] for a in node.names if a.name.startswith("raysweep."))
    return found - {""}


def _graph() -> dict[str, set[str]]:
    return {name: _imports(path) & set(MODULES) - {name} for name, path in MODULES.items()}


def _imports_module(path: Path, top: str) -> list[int]:
    """Lines where `path` imports the top-level package `top` (ray, mlflow, ...)."""
    def hit(node):
        if isinstance(node, ast.Import):
            return any(a.name.split(".")[0] == top for a in node.names)
        return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == top and not node.level

    return [node.lineno for node in ast.walk(ast.parse(path.read_text())) if hit(node)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (a → b → … → a), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = _graph()
    assert {"cluster", "console", "sweep", "tracking", "probe", "worker.entry", "worker.step"} <= set(graph)
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph))


DRIVER_ROOMS = {"cli", "cluster", "sweep", "probe", "tracking", "console", "report", "asha", "callbacks", "relay",
                "resume", "slots"}


def test_probe_never_imports_sweep_and_the_rank_side_never_imports_the_driver_side():
    graph = _graph()
    assert "sweep" not in graph["probe"]
    workers = [name for name in graph if name.startswith("worker.")]
    assert len(workers) >= 10
    for name in workers:
        assert not graph[name] & DRIVER_ROOMS, (name, graph[name] & DRIVER_ROOMS)
    assert not graph["metrics"]  # names and records: the bottom of the house
    for name in (n for n in graph if n == "data" or n.startswith("data.")):
        assert not graph[name] & (DRIVER_ROOMS | {"console"}), name  # progress comes in as a callback


def test_only_the_worker_entry_point_talks_to_ray_and_no_worker_file_is_near_400_lines():
    """A reader changing the Ray glue opens worker/entry.py, never the step."""
    for name, path in MODULES.items():
        if name.startswith("worker"):
            assert bool(_imports_module(path, "ray")) == (name == "worker.entry"), name
            assert len(path.read_text().splitlines()) < 350, name


def _calls(path: Path, predicate) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text())) if predicate(node)]


def test_only_console_prints_and_only_tracking_talks_to_mlflow():
    def is_print(node):
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"

    for path in MODULES.values():
        prints = _calls(path, is_print)
        if path.stem == "cli":  # the one error line of `main`
            assert len(prints) == 2, prints
        elif path.stem != "console":
            assert not prints, f"{path.name} prints at lines {prints}: console.py prints"
        if not _name(path).startswith("tracking"):
            assert not _imports_module(path, "mlflow"), f"{path.name} imports mlflow: tracking/ writes MLflow"


def test_epoch_metrics_are_the_names_the_report_carries():
    from raysweep.metrics import METRIC_NAMES, WORKER_PARAMS, EpochMetrics, WorkerParams, report_dict

    metrics = EpochMetrics(**{f.name: 1 for f in fields(EpochMetrics)})
    params = WorkerParams("cpu (1 threads)", "fp32", 16, 2, 1, "n1,n2", 6, 1234)
    report = report_dict(metrics, params)
    assert tuple(report) == METRIC_NAMES + WORKER_PARAMS
    assert all(isinstance(v, (int, float, str)) for v in report.values())  # Ray Train rejects tensors


@pytest.mark.parametrize("epoch, errored, expected",
                         [(6, False, "finished"), (2, False, "pruned"), (6, True, "failed")])
def test_one_rule_for_finished_pruned_failed(epoch, errored, expected):
    from raysweep.metrics import Horizon, TrialView

    horizon = Horizon("epoch", 6)
    assert horizon.outcome({"epoch": epoch}, errored) == expected

    class Trial:  # what Tune's callbacks see: still RUNNING while on_trial_complete / on_trial_error run
        trial_id, status, config, last_result = "t1", "RUNNING", {}, {"epoch": epoch}
        error_file, error_msg = None, "ValueError: boom"

    view = TrialView.of_trial(Trial(), horizon, ended="error" if errored else "complete")
    assert view.status == expected and (view.error == "ValueError: boom") == errored
    assert TrialView.of_trial(Trial(), horizon).status == "running"


def test_a_trial_that_ran_its_own_epochs_or_reached_its_horizon_finished():
    """Under a time budget a trial runs the epochs that fill it (resolved_epochs): ending there is finishing, not
    being pruned; in seconds, reaching max_t is; with tune.target's stop, reaching the target is."""
    from raysweep.metrics import Horizon

    seconds = Horizon("train_seconds", 60.0)
    assert seconds.outcome({"epoch": 4, "resolved_epochs": 4, "train_seconds": 41.0}, False) == "finished"
    assert seconds.outcome({"epoch": 3, "resolved_epochs": 9, "train_seconds": 61.0}, False) == "finished"
    assert seconds.outcome({"epoch": 3, "resolved_epochs": 9, "train_seconds": 31.0}, False) == "pruned"
    stop = Horizon("epoch", 6, stop_at_target=True)
    assert stop.outcome({"epoch": 2, "resolved_epochs": 6, "time_to_target_s": 3.0}, False) == "finished"
    assert Horizon("epoch", 6).outcome({"epoch": 2, "resolved_epochs": 6, "time_to_target_s": 3.0}, False) == "pruned"


def test_time_to_target_is_interpolated_between_the_epochs_that_straddle_it_and_ranks_first():
    from raysweep.metrics import rank, to_target

    # 0.5 at 10 s (epoch 2, 200 samples), 0.9 at 20 s (epoch 3, 300 samples): 0.7 lies halfway
    assert to_target((10.0, 2.0, 200.0, 0.5), (20.0, 3.0, 300.0, 0.9), 0.7) == pytest.approx((15.0, 2.5, 250.0))
    assert to_target(None, (4.0, 1.0, 100.0, 0.8), 0.7) == (4.0, 1.0, 100.0)  # reached in its first epoch
    trials = {"slow": {"val_exact_acc": 0.95, "time_to_target_s": 30.0}, "fast": {"val_exact_acc": 0.8,
              "time_to_target_s": 12.0}, "never": {"val_exact_acc": 0.6}, "best_never": {"val_exact_acc": 0.65},
              "silent": {}}

    def value(name, key):
        return trials[name].get(key)

    assert rank(list(trials), value, "val_exact_acc", "max", target=True) == ["fast", "slow", "best_never", "never"]
    assert rank(list(trials), value, "val_exact_acc", "max") == ["slow", "fast", "best_never", "never"]


def test_train_summary_is_printed_without_a_startup(capsys):
    """Bug: the conditional at the end of an implicitly joined f-string blanked the whole line."""
    from raysweep.console import print_train_summary
    from raysweep.metrics import RunRecord

    last = {"epoch": 3, "train_loss": 3.1, "val_loss": 3.2, "val_exact_acc": 0.0, "val_char_acc": 0.1,
            "samples_per_s": 250.0}
    best = RunRecord("r1", "t1", "finished", {"global_batch_size": "32", "peak_lr": "0.001"},
                     {name: {3: value} for name, value in last.items()}, {}, 12.0)
    print_train_summary(best, 12.0, None)
    line = capsys.readouterr().out.strip()
    assert line.startswith("summary: 3 epochs in 12s; global batch 32") and "started in" not in line
    phases = {"startup_s": 9.5, "startup_driver_s": 0.5, "startup_wait_s": 0.0, "startup_group_s": 7.0,
              "startup_data_s": 0.5, "startup_model_s": 0.5, "startup_probe_s": 1.0}
    print_train_summary(best, 12.0, phases)
    assert capsys.readouterr().out.strip().endswith(
        "started in 9.5s (driver 0.5 · wait 0.0 · group 7.0 · data 0.5 · model 0.5 · probe 1.0)")


# what a docstring or comment may write that looks like `module.Name` and is no reference to a module: file names
# (report.html, state.pt) and a spec's keys (data.charset, search.per_gpu_batch_size), checked against the spec
FILE_SUFFIXES = {"py", "html", "yaml", "yml", "pt", "json", "png", "md", "txt", "db", "log", "sh", "npz", "toml",
                 "csv", "svg", "jpg", "gz"}
CITATION = re.compile(r"(?<![\w./])((?:[a-z_][a-z0-9_]*[./])*[a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)*)")


def _prose(path: Path):
    """(line, text) of every comment and docstring in a file."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def _resolves(module: str, chain: list[str]) -> bool:
    """Whether raysweep.`module` has the attribute path `chain` (a submodule, a function, a class and its members;
    a dataclass's or pydantic model's field counts)."""
    obj = importlib.import_module(f"raysweep.{module}")
    for name in chain:
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif isinstance(obj, type) and (name in getattr(obj, "__annotations__", {})
                                        or name in getattr(obj, "model_fields", {})):
            return True
        else:
            try:
                obj = importlib.import_module(f"{obj.__name__}.{name}")
            except (ImportError, AttributeError):
                return False
    return True


def test_every_module_name_a_docstring_or_comment_cites_resolves():
    """`sweep.run_trial`, `tracking.make_mlflow_callback`, `sweep.ResumeSummary`: docstrings named functions that
    had moved, and a reader following them found nothing. Every `module.Name` (or `worker/entry.Name`) in the
    package's prose whose module is a raysweep module must resolve; a spec key (`data.charset`) must be a field of
    its section."""
    from raysweep.config import SweepConfig

    modules = {_name(p) for p in PACKAGE.rglob("*.py")} - {""}
    sections = {k: v.annotation for k, v in SweepConfig.model_fields.items() if hasattr(v.annotation, "model_fields")}
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _prose(path):
            for m in CITATION.finditer(text):
                module, name = m.group(1).replace("/", ".").removeprefix("raysweep."), m.group(2)
                chain = [name, *filter(None, m.group(3).split("."))]
                if module not in modules or name in FILE_SUFFIXES:
                    continue
                if module in sections and name in sections[module].model_fields:
                    continue  # a spec key
                if not _resolves(module, chain):
                    broken.append(f"{path.relative_to(ROOT)}:{line} {m.group(0)}")
    assert not broken, "cited, but no such name:\n" + "\n".join(broken)
