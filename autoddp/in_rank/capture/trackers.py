"""Experiment trackers: one run for the distributed run, rank 0's; the other ranks' trackers make nothing.

One process makes one tracker run; the same code in N processes would make N (N wandb runs, N
event files in one TensorBoard folder, drawn as one zig-zag curve, N MLflow runs). While capture
runs, the trackers the user's code imports (before capture or during it: ``_imports``; none is
imported here) are adapted, on rank 0 to say so in the notice and on every other rank to make
nothing, through each library's own switch where it has one:

- ``wandb.init``: on the other ranks called with ``mode="disabled"`` (wandb's switch; the argument
  outranks ``WANDB_MODE`` and ``settings``): a run object whose ``log`` does nothing;
- ``torch.utils.tensorboard.SummaryWriter``: no switch; on the other ranks the writer gets a
  subclass of its class (same name) whose file writer and ``add_*`` methods do nothing: no event
  file, no folder;
- ``tensorboardX.SummaryWriter``: called with ``write_to_disk=False`` (and its Comet logging
  ``disabled``), its switches;
- MLflow's fluent API (``mlflow.start_run``, ``log_*``, ``set_tag``...): no switch; on the other
  ranks ``start_run`` makes no run (a stand-in that lives nowhere, also ``active_run``'s until its
  ``end_run``), and the ``log_*`` and tag functions and ``Model.log`` (every flavour's
  ``log_model``) do nothing. ``MlflowClient`` used directly is left as it is.

Rank 0's trackers are left exactly as they are; the notice says whose values they record.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from autoddp.core import _class_swap, _patches
from autoddp.core.state import World
from autoddp.in_rank.capture._imports import Watch
from autoddp.in_rank.capture._notice import where
from autoddp.in_rank.capture._registry import user_site

#: The modules whose trackers are adapted, once imported (by the user's code).
WATCHED = ("wandb", "torch.utils.tensorboard", "tensorboardX", "mlflow")
#: MLflow's fluent functions that write to the active run or experiment, besides ``log_*``.
_MLFLOW_TAGS = (
    "set_tag",
    "set_tags",
    "delete_tag",
    "set_experiment_tag",
    "set_experiment_tags",
    "delete_experiment_tag",
)


class Trackers:
    """The tracker hooks of one capture session (see the module's docstring)."""

    def __init__(self, session: Any, known: World | None) -> None:
        """``known``: the world this process is in (or will be), None when not known yet."""
        self.session = session
        self.rank = known.rank if known is not None else 0
        self.world_size = known.world_size if known is not None else 1
        self._patches = _patches.Patches()
        self._watch = Watch(WATCHED, self._arrived)
        #: MLflow runs started on this rank (not rank 0): stand-ins, innermost last.
        self.mlflow_runs: list[NoRun] = []
        self._explained = False  # whose values they record: said in the first tracker's line only

    def install(self) -> None:
        if self.world_size > 1:
            self._watch.start()

    def uninstall(self) -> None:
        self._watch.stop()
        self._patches.restore()
        self.mlflow_runs = []

    def _arrived(self, module: types.ModuleType) -> None:
        adapt = {
            "wandb": self._wandb,
            "torch.utils.tensorboard": self._tensorboard,
            "tensorboardX": self._tensorboardx,
            "mlflow": self._mlflow,
        }[module.__name__]
        adapt(module)

    # --- the notice ---------------------------------------------------------------------------

    def say(self, kind: str, tracker: str, what: str, others: str, made: Any = None) -> None:
        """The notice's one line for a kind of tracker, said at its first use (``what``: rank 0's;
        ``others``: what the other ranks' make; ``made``: the object being constructed)."""
        notice = self.session.notice
        if notice is None or ("tracker", kind) in notice.said:
            return
        site = where(user_site(sys._getframe(2), made=made))
        count = self.world_size - 1
        processes = "the other process" if count == 1 else f"the other {count} processes"
        whose = "it records rank 0's values, as above" if self._explained else self.whose()
        self._explained = True
        notice.say(("tracker", kind), f"{tracker} ({site}): {what}, rank 0's; {processes}: {others}; {whose}")

    def whose(self) -> str:
        """Whose values rank 0's tracker records, in words."""
        evaluation = (
            "a DataLoader's evaluation pass is whole on every rank, so its metrics are the whole set's"
        )
        if self.session.options.split_batches:
            return (
                "it records rank 0's values: a loss read after its backward is the whole batch's (as one "
                f"process logs it), other values of a training batch rank 0's part's; {evaluation}"
            )
        return (
            "it records rank 0's values: a training loss is rank 0's own batch's (one of the "
            f"{self.world_size} processed at each step), not the mean over the processes; {evaluation}"
        )

    # --- wandb --------------------------------------------------------------------------------

    def _wandb(self, module: types.ModuleType) -> None:
        if callable(getattr(module, "init", None)):
            self._patches.install([_patches.wrapping(module, "init", self._wandb_init)])

    def _wandb_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        switch = _Switch(original, mode="disabled")

        def init(*args: Any, **kwargs: Any) -> Any:
            self.say("wandb", "wandb.init", "one run", 'wandb.init(mode="disabled"), nothing logged')
            if self.rank != 0:
                args, kwargs = switch(args, kwargs)
            return original(*args, **kwargs)

        return init

    # --- TensorBoard --------------------------------------------------------------------------

    def _tensorboard(self, module: types.ModuleType) -> None:
        writer = getattr(module, "SummaryWriter", None)
        if isinstance(writer, type):
            self._patches.install([_patches.wrapping(writer, "__init__", self._writer_init)])

    def _writer_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(writer: Any, /, *args: Any, **kwargs: Any) -> None:
            if self.rank != 0 and _class_swap.PLAIN_CLASS not in type(writer).__dict__:
                _class_swap.swap_class(writer, silent_writer(type(writer)))
            original(writer, *args, **kwargs)
            folder = getattr(writer, "log_dir", None)
            tracker = f"SummaryWriter({folder!r})"
            self.say("tensorboard", tracker, "one event file", "a writer that writes nothing", made=writer)

        return __init__

    def _tensorboardx(self, module: types.ModuleType) -> None:
        writer = getattr(module, "SummaryWriter", None)
        if isinstance(writer, type):
            self._patches.install([_patches.wrapping(writer, "__init__", self._writer_x_init)])

    def _writer_x_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        switch = _Switch(original, write_to_disk=False, comet_config={"disabled": True})

        def __init__(writer: Any, /, *args: Any, **kwargs: Any) -> None:
            if self.rank != 0:
                (writer, *args), kwargs = switch((writer, *args), kwargs)
            original(writer, *args, **kwargs)
            tracker = f"tensorboardX.SummaryWriter({getattr(writer, 'logdir', None)!r})"
            self.say("tensorboardX", tracker, "one event file", "write_to_disk=False", made=writer)

        return __init__

    # --- MLflow -------------------------------------------------------------------------------

    def _mlflow(self, module: types.ModuleType) -> None:
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None or not callable(vars(fluent).get("start_run")):
            return
        makers: dict[str, Callable[[Any], Any]] = {"start_run": self._start_run}
        if self.rank != 0:
            makers.update(end_run=self._end_run, active_run=self._active_run)
            writes = [name for name in vars(fluent) if name.startswith("log_") or name in _MLFLOW_TAGS]
            makers.update((name, _nothing) for name in writes if inspect.isfunction(vars(fluent)[name]))
        patches = []
        for name, make in makers.items():
            original = vars(fluent).get(name)
            if not callable(original):
                continue
            replacement = functools.wraps(original)(make(original))
            patches += [
                (owner, name, replacement) for owner in (fluent, module) if vars(owner).get(name) is original
            ]
        model = getattr(sys.modules.get("mlflow.models.model"), "Model", None)
        log = vars(model).get("log") if isinstance(model, type) else None
        if self.rank != 0 and isinstance(log, classmethod):  # every flavour's log_model
            patches.append((model, "log", classmethod(functools.wraps(log.__func__)(_nothing(log)))))
        self._patches.install(patches)

    def _start_run(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = _signature(original)

        def start_run(*args: Any, **kwargs: Any) -> Any:
            others = "no run; their mlflow.log_*, tags and log_model do nothing"
            self.say("mlflow", "mlflow.start_run", "one run", others)
            if self.rank == 0:
                return original(*args, **kwargs)
            run = NoRun(_argument(signature, args, kwargs, "run_name"), self.mlflow_runs)
            self.mlflow_runs.append(run)
            return run

        return start_run

    def _end_run(self, original: Any) -> Callable[..., None]:
        def end_run(*args: Any, **kwargs: Any) -> None:
            if self.mlflow_runs:
                self.mlflow_runs.pop()

        return end_run

    def _active_run(self, original: Any) -> Callable[..., Any]:
        def active_run(*args: Any, **kwargs: Any) -> Any:
            return self.mlflow_runs[-1] if self.mlflow_runs else None

        return active_run


class NoRun:
    """What ``mlflow.start_run`` gives on a rank other than 0: a run that exists nowhere (its ``info``
    and ``data`` read as an empty run's; a ``with`` block ends it as ``end_run`` does)."""

    def __init__(self, run_name: Any, active: list[NoRun]) -> None:
        """``active``: this rank's stand-ins started and not ended (its ``with`` block ends it there)."""
        self.info = types.SimpleNamespace(
            run_id=None, run_name=run_name, experiment_id=None, artifact_uri=None, status="RUNNING"
        )
        self.data = types.SimpleNamespace(metrics={}, params={}, tags={})
        self._active = active

    def __enter__(self) -> NoRun:
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self in self._active:
            self._active.remove(self)
        return False


def _nothing(original: Any) -> Callable[..., None]:
    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    return nothing


def silent_writer(cls: type) -> type:
    """``cls`` (a ``torch.utils.tensorboard.SummaryWriter``) whose writing does nothing: its file
    writer is a stand-in that writes no file, and every ``add_*``, ``flush`` and ``close`` returns
    at once (``add_scalars`` and ``add_hparams`` would make writers and files of their own)."""
    quiet = sorted(name for name in dir(cls) if name.startswith("add_") and callable(getattr(cls, name)))
    extra: dict[str, Any] = {name: _do_nothing for name in (*quiet, "flush", "close")}
    extra.update({"_get_file_writer": _no_file_writer, _class_swap.PLAIN_CLASS: cls})
    return _class_swap.cached_subclass(cls, extra)


def _do_nothing(self: Any, /, *args: Any, **kwargs: Any) -> None:
    return None


def _no_file_writer(self: Any, /) -> NoFileWriter:
    return NoFileWriter(getattr(self, "log_dir", None))


class NoFileWriter:
    """A TensorBoard file writer that writes nothing (``get_logdir`` still names the folder)."""

    def __init__(self, folder: Any) -> None:
        self.folder = folder

    def get_logdir(self) -> Any:
        return self.folder

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _nowhere


def _nowhere(*args: Any, **kwargs: Any) -> None:
    return None


def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def _argument(signature: inspect.Signature | None, args: tuple, kwargs: dict, name: str) -> Any:
    """The value a call gives the parameter ``name`` (None where it does not bind)."""
    if signature is None:
        return kwargs.get(name)
    try:
        return signature.bind(*args, **kwargs).arguments.get(name)
    except TypeError:
        return None


class _Switch:
    """A library's own switches, set on a call: its arguments with ``values`` given to those of its
    parameters (positional or keyword); a call that does not bind, or a version without them, as it is."""

    def __init__(self, function: Callable[..., Any], **values: Any) -> None:
        self.signature = _signature(function)
        known = self.signature.parameters if self.signature is not None else {}
        self.values = {name: value for name, value in values.items() if name in known}

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.signature is None or not self.values:
            return args, kwargs
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:  # the library's own error, from the call itself
            return args, kwargs
        bound.arguments.update(copy.deepcopy(self.values))  # (a dict the library may change: its own)
        return bound.args, bound.kwargs
