"""The one training loop: a trial's model, optimizer and data, and its optimizer steps
(accumulation, precision, clipping, schedule); logging, evaluation, pruning, checkpoints and the
method's own step are callbacks on its events (harness/train/hooks.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from harness import distributed
from harness.config import RunConfig
from harness.cost import meter
from harness.cost.grad_peak import GradPeak
from harness.distributed import fsdp
from harness.distributed.host import LateFlag
from harness.methods import memory_of
from harness.train import checkpointing, setup
from harness.train.averaged import averaged
from harness.train.hooks import Hooks, Interrupted, NonFinite, Pruned, Step
from harness.trials import Records, Status
from harness.trials.events import event_text, say_event

Prune = Callable[[int, dict[str, float]], bool]  # (step, eval metrics) -> cut the trial?


class Trainer:
    """One trial's model, optimizer, data and loop; with W processes, one data-parallel rank:
    `steps.accumulation` micro-batches, its share of the step (Prefetcher). The loss is divided
    by the step's target count over all ranks and multiplied by W, which DDP's gradient average
    cancels: gradients equal one process's. Layer-wise optimizers reduce in their hooks
    (harness/modifiers/layerwise.py). Logged and eval losses are summed over ranks; a stop is
    agreed one step late (no host sync in the step), a prune at each evaluation; only rank 0
    writes (train() gives the others `main_only`)."""

    def __init__(self, run: RunConfig, rec: Records, should_stop: Callable[[int], bool],
                 prune: Prune | None = None):
        """The setup in named steps (harness/train/setup.py), in the order each needs the one
        before: DESIGN's list, with the process group joined first, the budget in epochs turned
        into steps before the method reads it, and DDP's wrap after resume (it depends on the
        optimizer; fsdp shards in `parallelize`, before the optimizer)."""
        self.run, self.rec, self.should_stop, self.prune = run, rec, should_stop, prune
        self.steps, self.device = setup.join(run)
        built = time.perf_counter()
        model, self.tok, self.data = setup.model(run, self.steps, self.device)
        self.run = run = setup.budget(run, self.data)
        self.method, self.warnings = setup.method(run, self.steps, model)  # warnings: summary
        self.model, self.offloader = setup.modifiers(model, self.method, run, self.device)
        self.sharded = setup.parallelize(self.model, run, self.steps, self.device)
        self.loss = setup.compile_model(self.model, self.data, run.train, rec.out)
        self.optimizer, self.precision = setup.optimizer(self.method, self.model, run,
                                                         self.device)
        self.build_s = time.perf_counter() - built  # model, method and optimizer: not launching
        self.scheduler = setup.schedule(self.optimizer, self.method, run)
        self._resume()
        self._wrap()
        self._meters()
        self._register()

    def _resume(self) -> None:
        """Model, optimizer, schedule, data, RNG, precision and counters from the last
        checkpoint (harness/train/checkpointing.py); without one, counters from zero."""
        self.step, self.tokens = 0, 0
        self.last_eval: dict[str, float] = {}
        self.best: dict[str, float] = {}  # fine-tuning: the evaluation with the best score
        self.costs: dict[str, Any] = {}
        self.grad_norms = [0.0, 0]  # the logged steps' pre-clip gradient norms: sum, count
        self.background = checkpointing.background(self.run, self.sharded)  # async saves
        checkpointing.resume(self)

    def _wrap(self) -> None:
        """`net` is what forward runs through: DDP, or the model itself (one process, fsdp, or
        layer-wise). Wrapped again when ReLoRA's warm start freezes weights DDP waits for."""
        self.net = self.model if self.sharded else distributed.wrap(self.model, self.device,
                                                                     self.layerwise)
        self._trainable = distributed.trainable(self.model)

    @property
    def layerwise(self) -> bool:
        """Updates run inside backward, one parameter at a time (harness/modifiers/layerwise.py)."""
        return getattr(self.optimizer, "layerwise", False)

    def _meters(self) -> None:
        """Throughput, cost and offload counters, from the step resumed at."""
        # the first step's gradient bytes, counted as they arrive (layer-wise frees them early)
        self.grad_peak = None if self.costs else GradPeak(self.model, self.optimizer)
        self.meter = meter.Meter(self.device)
        self.flops_per_token = meter.flops_per_token(self.model, self.run.task.seq_len)
        self.offloaded = 0  # activation bytes moved to the host, over the steps run here
        self.first_step = self.step
        self.first_step_at: float | None = None  # set as `fit` starts
        self.first_s: float | None = None  # the first step's seconds, compilation included
        self.window: list[torch.Tensor] = []  # this rank's step losses since the last log
        self.grad_norm: torch.Tensor | None = None  # this step's, on a step a line logs
        self.eval_every = self.run.eval.every or (self.data.steps_per_epoch or 0)  # glue: epochs
        self.stop_flag = LateFlag()  # a stop asked at step n: every rank's at n + 1

    def _register(self) -> None:
        """The trainer's own jobs, on the events of hooks.py, in the order they run."""
        self.hooks = Hooks()
        on = self.hooks.on
        if self.offloader is not None:
            on("update", self._count_offloaded)
        on("update", self._method_step)
        on("update", self._count_costs)
        on("update", self._keep_loss)
        on("step_end", self._time)
        on("step_end", self._log)
        on("step_end", self._eval)
        on("step_end", self._checkpoint)
        on("eval", self._prune)

    def _settle(self) -> None:
        """fp16: an event line for each step skipped since the last read."""
        for step in self.precision.settle():
            self.rec.log({"kind": "event", "step": step, "skipped": "overflow"})

    def save(self) -> None:
        """The trainer's checkpoint (harness/train/checkpointing.py), fp16's skips logged first."""
        self._settle()
        checkpointing.save(self, self.background)

    def train_step(self) -> torch.Tensor:
        """One optimizer step, then "update"; returns this rank's share of the step's mean loss."""
        world = self.steps.world
        micro, tokens = zip(*(self.data.next() for _ in range(self.steps.accumulation)),
                            strict=True)
        self.step_tokens = sum(tokens) * world
        targets = sum(self.data.count(batch) for batch in micro)
        targets = distributed.all_sum(targets)  # the whole step's, over every rank
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            last = i == len(micro) - 1
            if self.layerwise:  # updates run inside backward: only once the gradient is complete
                self.optimizer.sync = last
            with self._reduce(last):
                with self.precision.autocast():
                    loss = self.loss(self.net, batch)
                self.precision.backward(loss * world / targets)  # × W undoes DDP's average
            total += loss.detach()
        clip = None if self.layerwise else self.run.train.grad_clip  # layer-wise: per parameter
        # the norm a log line records; layer-wise updates free each gradient inside backward
        measure = not self.layerwise and self._logged(self.step + 1)
        grads = clip or measure or self.precision.scaler is not None  # fp16 checks their norm
        params = [p for p in self.model.parameters() if p.grad is not None] if grads else []
        self.lr = self.optimizer.param_groups[0]["lr"]  # torchao's: a tensor, read when logged
        norm = self.precision.step(self.optimizer, params, clip, self.step + 1, measure)
        self.grad_norm = norm if measure else None  # read at the log line: no sync before it
        self.scheduler.step()
        loss = total / targets
        self.hooks.fire("update", Step(self.step + 1, loss, self.step + 1 == self.run.train.steps))
        self.optimizer.zero_grad(set_to_none=True)
        if self.net is not self.model and distributed.trainable(self.model) != self._trainable:
            self._wrap()
        return loss

    def _reduce(self, last: bool) -> AbstractContextManager[Any]:
        """fsdp reduce-scatters every micro-batch's gradients into the shards they add up in
        (`fsdp_reduce: every`), or only the last's (`last`: whole ones add up before it); DDP
        reduces in the last micro-batch's backward only."""
        if self.sharded:
            every = self.run.train.fsdp_reduce == "every"
            self.model.set_requires_gradient_sync(last or every)  # type: ignore[operator]
            return nullcontext()
        return self.net.no_sync() if self.net is not self.model and not last else nullcontext()

    def _count_offloaded(self, step: Step) -> None:
        self.offloaded += self.offloader.take_bytes()  # type: ignore[union-attr]

    def _method_step(self, step: Step) -> None:
        """The method's own step (ReLoRA's merge and reset, Q-GaLore's SVDs); its events logged."""
        events = self.method.on_step(step.number, self.model, self.optimizer)
        if events:
            self.rec.log({"kind": "event", "step": step.number, **events})
            if distributed.is_main():  # an internal line: on the terminal under --verbose
                say_event(f"step {step.number}: {event_text(events)}")

    def _count_costs(self, step: Step) -> None:
        if self.grad_peak is not None:  # gradients and states exist now: count them once
            grads, self.grad_peak = self.grad_peak.close(), None
            self.costs = meter.breakdown(memory_of(self.method), self.model, self.optimizer,
                                         grads)

    def _keep_loss(self, step: Step) -> None:
        self.window.append(step.loss)  # read at the next log line: no host sync before it

    def evaluate(self) -> dict[str, float]:
        """The eval metrics, at the optimizer's averaged weights where it keeps them apart
        (Schedule-Free's x: harness/train/averaged.py)."""
        self.model.eval()
        try:
            with averaged(self.optimizer, self.model):
                return self.data.evaluate(self.model, self.precision, self.sharded)
        finally:
            self.model.train()

    def fit(self) -> Status:
        """Steps to the budget, each followed by its events: OK, or INTERRUPTED when a stop
        was asked for before the last step."""
        budget = self.run.train.steps
        self.model.train()
        self.meter.resume()
        self.first_step = self.step
        self.first_step_at = time.time()  # `harness bench launch`: launch → training
        self.window = []
        try:
            while self.step < budget:
                loss = self.train_step()
                self.step += 1
                self.tokens += self.step_tokens
                done = Step(self.step, loss, last=self.step == budget)
                self.hooks.fire("step", done)
                self.hooks.fire("step_end", done)
        except Interrupted:
            return Status.INTERRUPTED
        return Status.OK

    def _time(self, step: Step) -> None:
        self.meter.add(self.step_tokens)
        if step.number == self.first_step + 1:  # one-off costs: the first step is not steady
            self.first_s = self.meter.lap(steady=step.last)[0]

    def _logged(self, number: int) -> bool:
        return number % self.run.train.log_every == 0 or number == self.run.train.steps

    def _log(self, step: Step) -> None:
        """Every `log_every` steps and the last: the step's loss summed over ranks and its
        gradient norm. A loss that became NaN or Inf since the last line ends the trial at the
        step it happened."""
        if not self._logged(step.number):
            return
        losses = distributed.all_sum(torch.stack(self.window))  # each step's, over ranks
        self.window = []
        seconds, tps = self.meter.lap()
        self._settle()
        bad = torch.nonzero(~torch.isfinite(losses))
        if len(bad):
            first = int(bad[0])
            raise NonFinite(float(losses[first]), self.step - len(losses) + 1 + first)
        lr, value = float(self.lr), float(losses[-1])
        self.rec.log(
            {
                "kind": "train",
                "step": self.step,
                "loss": value,
                "lr": lr,
                "tokens": self.tokens,
                "tokens_per_s": tps,
                "step_time_s": seconds,
                "memory_bytes": meter.current_memory(self.device),
                **self._grad_norm(),
                **self.precision.log(),
            }
        )
        distributed.say(
            f"step {self.step}/{self.run.train.steps} loss {value:.4f} lr {lr:.2e} "
            f"tok/s {tps:,.0f}"
        )

    def _grad_norm(self) -> dict[str, float]:
        """The logged step's pre-clip gradient norm, over every rank's shard under fsdp, and
        counted toward the trial's mean; none under layer-wise updates or where fp16's
        gradients overflowed (the step was skipped)."""
        if self.grad_norm is None:
            return {}
        value = float(fsdp.full(self.grad_norm))
        if not math.isfinite(value):
            return {}
        self.grad_norms = [self.grad_norms[0] + value, self.grad_norms[1] + 1]
        return {"grad_norm": value}

    def _eval(self, step: Step) -> None:
        """Every `eval.every` steps (GLUE: every epoch) and the last; then "eval"."""
        if not (step.last or (self.eval_every and step.number % self.eval_every == 0)):
            return
        self.meter.pause()
        self.last_eval = self.evaluate()
        if self.data.steps_per_epoch:
            self.last_eval["epoch"] = self.step / self.data.steps_per_epoch
        self.rec.log({"kind": "eval", "step": self.step, "tokens": self.tokens, **self.last_eval})
        shown = [(k, self.last_eval.get(f"eval_{k}")) for k in ("loss", "ppl", "score")]
        distributed.say(f"eval step {self.step}: "
                        + " ".join(f"{k} {v:.4f}" for k, v in shown if v is not None))
        score = self.last_eval.get("eval_score")
        if score is not None and score > self.best.get("best_eval_score", -math.inf):
            self.best = {f"best_{k}": v for k, v in self.last_eval.items()}
        self.meter.resume()
        if not step.last:
            self.hooks.fire("eval", step)

    def _prune(self, step: Step) -> None:
        prune = bool(self.prune and distributed.is_main() and self.prune(step.number,
                                                                         self.last_eval))
        if distributed.any_rank(prune, self.device):  # rank 0 asks the study; all obey
            raise Pruned(f"pruned by the study at step {step.number}")

    def _checkpoint(self, step: Step) -> None:
        """Every `checkpoint_every` steps, the last, and when any rank was asked to stop (one
        process: at this step; W: at the previous one, so every rank stops at this one)."""
        every = self.run.train.checkpoint_every
        stop = self.stop_flag.agree(self.should_stop(step.number), step.last)
        if stop or step.last or (every and step.number % every == 0):
            self.meter.pause()
            self.save()
            self.meter.resume()
        if stop and not step.last:
            raise Interrupted(f"stopped at step {step.number}")

    def results(self) -> dict[str, Any]:
        tps = self.meter.tokens_per_s
        peak = meter.peak_flops(self.device, self.run.train.precision)
        self._settle()
        # tps counts every rank's tokens (step_tokens × W), and `peak` is one device's: W
        # devices did the work (CUDA only: a CPU has no peak, so no MFU)
        mfu = tps * self.flops_per_token / (peak * self.steps.world) if tps and peak else None
        return {
            "step": self.step,
            "steps": self.run.train.steps,
            "tokens": self.tokens,
            "build_s": self.build_s,
            "first_step_at": self.first_step_at,
            **self.last_eval,
            **self.best,
            "tokens_per_s": tps,
            **self._compile_s(),
            "grad_norm": self.grad_norms[0] / self.grad_norms[1] if self.grad_norms[1] else None,
            "mfu": mfu,
            "processes": self.steps.world,
            **self.meter.conditions(),
            **self.precision.log(),
            **self._offloaded(),
            **self.costs,
            **meter.peak_memory(self.device),
            **({"warnings": self.warnings} if self.warnings else {}),
        }

    def _compile_s(self) -> dict[str, float]:
        """train.compile: the first step's time beyond a steady step's (all of it when it was
        the only step), the one-off cost tokens_per_s leaves out."""
        if not self.run.train.compile or self.first_s is None:
            return {}
        ran, m = self.step - self.first_step, self.meter
        steady = m.train_s / m.tokens * self.step_tokens if ran > 1 and m.tokens else 0.0
        return {"compile_s": max(0.0, self.first_s - steady)}

    def _offloaded(self) -> dict[str, float]:
        """Activation bytes moved to the host per step: what offload took off the device."""
        ran = self.step - self.first_step
        if self.offloader is None or ran <= 0:
            return {}
        return {"offloaded_bytes_per_step": self.offloaded / ran}

    def close(self) -> None:
        checkpointing.close(self.background)  # a save in flight published first
        self.data.close()
