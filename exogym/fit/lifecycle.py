"""One run's life, from the claim of its folder to the record of how it ended, the same for every launcher and
backend: `open` claims the run folder (and the checkpoint folder), shows the run's numbers, starts the progress bar
and the loggers; `launch` runs the plan on its launcher with the caller's random streams and memory caps put back
after; `complete` or a failure ends it, and `_end` is the one place an ending is recorded (the progress bar, the
loggers' summary.json, the run folder's marker)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from exogym.engine.plan import RunPlan, RunSinks
from exogym.engine.rng import GlobalRNGState
from exogym.cluster.simtime import TimeModel
from exogym.fit.loggers import claim_run_folders
from exogym.fit.nodes import peak_memory_mb
from exogym.fit.plan import FitPlan
from exogym.fit.run_end import COMPLETED, INTERRUPTED, Ending, trace_non_finite
from exogym.runs.checkpoint import CheckpointPlan, check_checkpoint_space
from exogym.runs.folder import RunClaim, check_writable
from exogym.runs.loggers import default_run_name
from exogym.runs.progress import RunProgress
from exogym.runs.record import LiveLog, RunRecord

__all__ = ["RunLifecycle", "announce"]


class RunLifecycle:
    """One run on its way: what must be claimed before its nodes start, and recorded however it ends.

    Args:
        plan: the fit call's plan (data only: nothing claimed, started or printed yet).

    Attributes:
        claim: the run folder(s) claimed (None: nothing is written into a run folder, or not the main process).
        config: the record's config: the plan's, with the run's name once the run opened.
        run: the plan the processes run: the plan's, with its checkpoints once the run opened.
        record: the run's record, once it ended (None before, or when it failed before its nodes ran).
        ending: how it ended, once it did.
    """

    def __init__(self, plan: FitPlan):
        self.plan = plan
        self.config: dict[str, Any] = dict(plan.config)
        self.run: RunPlan = plan.run
        self.claim: RunClaim | None = None
        self.bar: RunProgress | None = None
        self.sinks: RunSinks | None = None
        self.record: RunRecord | None = None
        self.ending: Ending | None = None
        self.started = time.perf_counter()

    # ---- before any node starts -------------------------------------------------------------------------------
    def open(self) -> None:
        """Show the run's numbers, claim its folders, start the progress bar and the loggers; a failure on the way
        gives the claimed folders back."""
        p = self.plan
        if p.show_progress:
            announce(p.config, p.time_model)
            if p.resumed.message is not None:
                print(p.resumed.message, flush=True)
        resumed = p.resumed
        # The run folder(s), claimed last: everything that can be checked before any node starts has been.
        if p.is_main:
            default = default_run_name({"strategy": p.config["strategy"], "num_nodes": p.config["num_nodes"]})
            self.claim = claim_run_folders(p.logger, resumed.run_name if resumed.run_name is not None else p.run_name,
                                           default, extra_roots=["logs"] if p.default_checkpoints else [],
                                           overwrite=p.overwrite, resume_after=resumed.after,
                                           checkpoint_dir=p.checkpoint_dir)
        run_name = self.claim.name if self.claim is not None else \
            resumed.run_name or p.run_name or default_run_name(p.config)
        self.config = {**p.config, "run_name": run_name}
        try:
            checkpoints = None
            if p.checkpoints is not None:
                spec = p.checkpoints
                root = spec.root if spec.root is not None else Path("logs") / run_name / "checkpoints"
                checkpoints = CheckpointPlan(check_writable(root, "checkpoint_dir"), spec.interval, spec.keep,
                                             self.config, resumed.run_id, p.fingerprint)
                if p.is_main:  # the process claiming the run folders holds the checkpoint folder for the run
                    check_checkpoint_space(checkpoints.root, p.run.model, p.run.num_nodes)
                    self.claim = checkpoints.check_owner(overwrite=p.overwrite, claim=self.claim)
            self.bar = RunProgress(p.run.cfg.max_steps, initial=resumed.step) if p.show_progress else None
            live = LiveLog(p.logger, p.launcher.live_nodes(p.run.num_nodes), global_batch=self.config["global_batch"],
                           log_interval=p.log_interval, last_step=p.run.cfg.max_steps, progress=self.bar)
            if resumed.states is not None:
                live.add_resumed([state.log for state in resumed.states])  # the run's steps before its checkpoint
            self.run = dataclasses.replace(p.run, checkpoints=checkpoints)
            # A node stuck in native code: the run folder says so, then the process exits.
            self.sinks = RunSinks(live, on_stuck=self.fail)
            if p.logger is not None:
                p.logger.start(self.config)
                if resumed.states is not None:  # rows between the last written one and the checkpoint: written
                    live.fill_resumed(getattr(p.logger, "loggers", [p.logger]))
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Nothing ran: the bar goes, and the claimed run folder is given back."""
        if self.bar is not None:
            self.bar.close()
        if self.claim is not None:
            self.claim.abandon()

    # ---- running ----------------------------------------------------------------------------------------------
    def launch(self) -> list[Any]:
        """Run the plan on its launcher; the caller's random streams and memory caps are put back after.

        Returns:
            Every node's (log, state) in rank order.

        Raises:
            BaseException: what stopped the run (a non-finite loss traced to where it first appeared), once its
                ending is recorded; it holds the record and the run folder (`e.record`, `e.run_folder`) where it
                can.
        """
        self.started = time.perf_counter()
        caller_rng = GlobalRNGState.capture()  # the caller's random streams are theirs: put them back after
        try:
            self.plan.memory_cap.apply()
            return self.plan.launcher.launch(self.run, self.sinks)
        except BaseException as e:
            error = trace_non_finite(e, self.sinks.live.partial_logs())
            self.fail(error)  # what the nodes trained, also on the exception
            with contextlib.suppress(AttributeError):  # an exception type without a __dict__ keeps its own form
                error.record, error.run_folder = self.record, self.folder
            if self.ending.status == INTERRUPTED:
                self._note_interrupted(error)
            if error is e:
                raise
            raise error from None
        finally:
            caller_rng.restore()
            self.plan.memory_cap.reset()

    # ---- how it ended -----------------------------------------------------------------------------------------
    def complete(self, results: list[Any]) -> torch.nn.Module:
        """The run completed: its record (to the loggers and the run folder), and the global model as a new
        module."""
        logs, final_state = [log for log, _ in results], results[0][1]
        config = self.config
        self.record = RunRecord.from_nodes(logs, config=config, global_batch=config["global_batch"],
                                           wall_time_s=time.perf_counter() - self.started,
                                           peak_memory_mb=self._peak_memory(logs))
        self._end(Ending(COMPLETED), self.record)
        final_model = copy.deepcopy(self.plan.run.model).to(self.plan.devices[0])
        final_model.load_state_dict(final_state, strict=True)
        return final_model

    def _peak_memory(self, logs: list[Any]) -> dict[str, Any]:
        """Every process's peak memory, and the run's (exogym.fit.nodes.peak_memory_mb)."""
        launcher = self.plan.launcher
        owner = launcher.hosting[0].owner if launcher.hosting else ()
        return peak_memory_mb(self.plan.devices, logs, owner, caller_counts=launcher.caller_is_extra)

    def fail(self, error: BaseException) -> RunRecord | None:
        """The nodes ran and stopped part-way (or one is stuck, and its process is about to end): the record of
        every step they all completed (also to the loggers), and the ending recorded."""
        record = None
        if self.sinks is not None:
            with contextlib.suppress(Exception):  # e.g. a full disk under the logger: the record keeps the row
                self.sinks.live.log_newest_row()
            logs = self.sinks.live.partial_logs()
            record = RunRecord.from_nodes(logs, config=self.config, global_batch=self.config["global_batch"],
                                          wall_time_s=time.perf_counter() - self.started,
                                          peak_memory_mb=self._peak_memory(logs))
        checkpoints = self.run.checkpoints
        self.record = record
        self._end(Ending.of(error, checkpoints.root if checkpoints is not None else None), record)
        return record

    def _end(self, ending: Ending, record: RunRecord | None) -> None:
        """The one place a run's ending is recorded: the progress bar, the loggers (summary.json), the marker."""
        self.ending = ending
        summary = record.summary() if record is not None else {}
        if self.bar is not None:
            self.bar.close(summary) if ending.status == COMPLETED else self.bar.close()
        if self.plan.logger is not None:
            self.plan.logger.finish({**ending.summary(), **summary})
        if self.claim is not None:
            self.claim.release(ending.folder_status, ending.reason)

    def _note_interrupted(self, error: BaseException) -> None:
        """Say where an interrupted run stands and how to continue it."""
        steps = len(self.record.train) if self.record is not None else 0
        newest = self.ending.resume_from
        how = (f"continue it with fit(..., resume_from={newest!r})" if newest is not None else
               "it had no checkpoint to resume from (fit's checkpoint_interval saves them)")
        where = f" (run folder {self.folder})" if self.folder else ""
        if hasattr(error, "add_note"):
            error.add_note(f"exogym: the run was interrupted after {steps} trained step(s){where}; {how}")

    @property
    def folder(self) -> str | None:
        """The run folder (the first, when the loggers write several), once claimed; None when there is none (a
        run that failed before its first training row gives its folder back)."""
        folders = [f for f in self.claim.folders if f.is_dir()] if self.claim is not None else []
        return str(folders[0]) if folders else None


def announce(config: dict[str, Any], time_model: TimeModel | None) -> None:
    """The derived numbers of a run, shown once at its start."""
    c = config
    print(f"exogym: {c['strategy']} on {c['num_nodes']} node(s) [{c['backend']}, {c['devices'][0]}], "
          f"{c['parameters']:,} parameters; batch {c['batch_size']}/node = {c['global_batch']} global; "
          f"{c['max_steps']} steps ({c['steps_per_epoch']} per epoch); validation on {c['val_size']} examples "
          f"every {c['val_interval']} steps", flush=True)
    if time_model is not None:
        compute = ("measured wall time" if time_model.measured else
                   f"counted FLOPs at {', '.join(f'{f:.3g}' for f in sorted(set(time_model.device_flops)))} "
                   "FLOP/s per node")
        chaos = "" if time_model.slowdowns is None else f"; slowdowns {time_model.slowdowns.describe()}"
        print(f"exogym: simulated time on {time_model.network}; compute from {compute}; node speeds "
              f"{list(time_model.node_speeds)}{chaos}", flush=True)
