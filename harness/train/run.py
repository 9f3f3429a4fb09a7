"""One trial's lifecycle: start or resume, stop cleanly on a signal, and always leave a
summary saying how it ended."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from harness import distributed
from harness.config import RunConfig
from harness.cost.profile import profiled
from harness.cost.tensor_peak import tracked
from harness.distributed.watchdog import Watchdog, peer_lost
from harness.errors import UserError, first_line
from harness.train.export import finish, is_finished
from harness.train.loop import NonFinite, Prune, Pruned, Trainer
from harness.trials import CheckpointError, Records, Status, Summary
from harness.trials.events import say_event

# torch's CPU allocator reports a failed allocation (the host out of memory, or a ulimit) as a
# RuntimeError, not MemoryError: "DefaultCPUAllocator: can't allocate memory: you tried to..."
CPU_OOM = "DefaultCPUAllocator: can't allocate memory"


class _StopFlag:
    """SIGINT, SIGTERM and the launcher's requeue signals (a preemption or a time limit coming)
    ask for a clean stop: the current step ends and a checkpoint is saved. They stay caught
    until the summary is written: torchrun SIGTERMs the other ranks as soon as one ends (an
    interrupted rank ends non-zero), and a scheduler may signal twice, so one arriving while
    the trial wraps up must not end it."""

    def __init__(self, requeue: Sequence[signal.Signals] = ()) -> None:
        self.signals = tuple(dict.fromkeys((signal.SIGINT, signal.SIGTERM, *requeue)))
        self.set = False
        self.handlers: dict[int, Any] = {}

    def __call__(self, signum: int, frame: Any) -> None:
        self.set = True

    def __enter__(self) -> _StopFlag:
        self.handlers = {s: signal.signal(s, self) for s in self.signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)


def train(run: RunConfig, out: Path, should_stop: Callable[[int], bool] | None = None,
          profile_steps: int = 0, prune: Prune | None = None,
          requeue: Sequence[signal.Signals] = ()) -> dict:
    """Run (or resume) one trial in `out`; returns its summary, which is also on disk.
    Under DDP every rank calls this; only rank 0's records write. `profile_steps`: trace that
    many steps (harness/cost/profile.py); `prune`: asked at each evaluation whether to stop
    (an Optuna sweep's trial: its entry hands over its study's, harness/sweep/search/prune.py);
    `requeue`: the signals its launcher sends to have it checkpoint and stop, to be resumed."""
    records = Records(out, run)
    rec = distributed.main_only(records)
    previous = rec.summary()
    if previous and previous.status == Status.OK:
        done = _finished_before(run, rec, previous)
        if done is not None:
            return done
    out.mkdir(parents=True, exist_ok=True)
    rec.write_config()
    requeues = previous.get("requeues", 0) if previous else 0
    summary = Summary.start(run, out.name, requeues).to_dict()
    rec.write_summary({**summary, "pid": os.getpid()})
    start, trainer, by_peer = time.time(), None, False

    def lost(why: str, main_lost: bool) -> None:  # the watchdog's thread, as this rank leaves
        # rank 0 records the end; rank 1 does when rank 0 may be the one lost
        writer = records if main_lost and distributed.rank() == 1 else rec
        _record_lost(writer, summary, trainer, _wall_s(start, previous), why)

    with _StopFlag(requeue) as flag, Watchdog(run.train.peer_timeout_s, lost) as watch:
        try:
            trainer = Trainer(
                run, rec, lambda step: flag.set or bool(should_stop and should_stop(step)),
                prune,
            )
            summary["device"] = str(trainer.device)
            # torch's intra-op pool, sized by its launcher from the allocation (OMP_NUM_THREADS)
            summary["threads"] = torch.get_num_threads()
            say_event(f"threads: {summary['threads']}")  # also in the summary
            rec.start_wandb()
            # CPU: live tensors' peak in a steady step (one profiler at a time: not with --profile)
            with profiled(trainer, profile_steps, out), tracked(trainer, not profile_steps):
                summary["status"] = trainer.fit()
        except NonFinite as e:
            summary.update(status=Status.NAN, error=str(e), nan_step=e.step)
        except CheckpointError as e:  # none loads, or a save failed (a full disk): one line
            print(f"error: {e}", file=sys.stderr, flush=True)
            summary.update(status=Status.FAILED, error=str(e))
        except Pruned as e:
            print(e, flush=True)
            summary["status"] = Status.PRUNED
        except (torch.OutOfMemoryError, MemoryError) as e:
            summary.update(status=Status.OOM, error=first_line(e))
        except UserError as e:
            summary.update(status=Status.FAILED, error=str(e))
            raise
        except Exception as e:
            if isinstance(e, RuntimeError) and CPU_OOM in str(e):
                summary.update(status=Status.OOM, error=first_line(e))
            elif peer_lost(e):  # a peer's process is gone: its own failure, or resumable
                by_peer = True
                status, error = watch.peer_failure() or (Status.INTERRUPTED,
                                                         f"peer lost: {first_line(e)}")
                summary.update(status=status, error=error)
            else:
                traceback.print_exc(file=sys.stderr)
                summary.update(status=Status.FAILED, error=f"{type(e).__name__}: {e}")
        finally:
            failed = summary["status"] in (Status.FAILED, Status.OOM, Status.RUNNING)
            if failed and not by_peer:  # before leaving the group: the peers see why
                watch.post_failure(summary["status"], summary.get("error") or "")
            watch.stop()
            if trainer is not None:
                summary.update(trainer.results())
                trainer.close()
            summary["wall_s"] = _wall_s(start, previous)
            rec.write_summary(summary)
            rec.finish_wandb(summary)
            distributed.teardown(failed=failed or by_peer, meet=True)
    if summary["status"] == Status.OK and distributed.is_main():
        del trainer  # its model and optimizer: the export builds the model again on the host
        summary = _finish(run, rec, summary)
    return summary


def _wall_s(start: float, previous: Summary | None) -> float:
    """Seconds trained: since `start`, and before it when this run resumed an unfinished one."""
    resumed = previous and previous.status in (Status.INTERRUPTED, Status.RUNNING)
    return time.time() - start + ((resumed and previous.get("wall_s")) or 0)


def _record_lost(rec: Records, summary: dict, trainer: Trainer | None, wall_s: float,
                 why: str) -> None:
    """The end of a trial whose peer stopped answering, as its watchdog leaves: interrupted
    at the step this rank reached (its last checkpoint is what a resume reads)."""
    reached = {"step": trainer.step, "tokens": trainer.tokens} if trainer is not None else {}
    rec.write_summary({**summary, **reached, "status": Status.INTERRUPTED,
                       "error": f"peer lost: {why}", "wall_s": wall_s})


def _finish(run: RunConfig, rec: Records, summary: dict, state: dict | None = None) -> dict:
    """The final model written (from `state`, the final checkpoint, when it is loaded already)
    and the training state dropped (`train.keep_final`), after the process group is gone: a
    sharded checkpoint is consolidated here alone. When the model cannot be written (a full
    disk) the checkpoint stays and a later run finishes it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        summary.update(finish(run, rec.dir, summary, state))
    except CheckpointError as e:
        print(f"error: {e}; the final checkpoint is kept (`harness export` writes the model "
              "from it)", file=sys.stderr, flush=True)
        return summary
    rec.write_summary(summary)
    return summary


def _finished_before(run: RunConfig, rec: Records, previous: Summary) -> dict | None:
    """A trial that ended ok is not trained again: it is finished (its final model verifies,
    or it keeps none), or it is finished once its final model is written from its final
    checkpoint. None: that checkpoint is gone or not this config's, so it trains again,
    resuming from the newest checkpoint that loads."""
    if not is_finished(run, rec.dir, previous):
        state = _final_state(rec, previous)
        if state is None:
            return None
        if distributed.is_main():
            return _finish(run, rec, previous.to_dict(), state)
    print(f"{rec.out}: already finished (status ok); nothing to do", flush=True)
    return previous.to_dict()


def _final_state(rec: Records, previous: Summary) -> dict | None:
    """A finished trial's final checkpoint, if it loads (a folder holding another config's run
    is refused here); None: it resumes from the newest that does, or ends `failed` saying why
    none does."""
    try:
        state = rec.load_checkpoint()
    except CheckpointError:
        return None
    return state if state is not None and state["step"] == previous.get("step") else None
