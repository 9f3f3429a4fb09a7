"""The one training loop: accumulation, precision, clipping, schedule, eval, checkpoint, resume."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from harness import distributed
from harness.config import RunConfig
from harness.cost import meter
from harness.distributed import pick_device
from harness.methods import build_method
from harness.models import describe
from harness.modifiers import recompute as memory
from harness.modifiers.precision import Precision
from harness.train import finetune, pretrain
from harness.trials import Records, rng_state, set_rng_state


class NonFinite(Exception):
    """The loss became NaN or Inf: the trial ends with status `nan`."""


class Pruned(Exception):
    """The trial's Optuna study cut it at an evaluation: it ends with status `pruned`."""






Prune = Callable[[int, dict[str, float]], bool]  # (step, eval metrics) -> cut the trial?


class Trainer:
    """One trial's model, optimizer, data and loop; with W processes, one data-parallel rank:
    `total_batch_size / (batch_size·W)` micro-batches, its share of the step (Prefetcher). The
    loss is divided by the step's target count over all ranks and multiplied by W, which DDP's
    gradient average cancels: gradients equal one process's. Layer-wise optimizers reduce in
    their hooks (methods/layerwise.py). Logged and eval losses are summed over ranks; stop and
    prune are agreed every step; only rank 0 writes (train() gives the others `main_only`)."""

    def __init__(self, run: RunConfig, rec: Records, should_stop: Callable[[int], bool],
                 prune: Prune | None = None):
        self.run, self.rec, self.should_stop, self.prune = run, rec, should_stop, prune
        t = run.train
        self.accumulation = distributed.local_accumulation(t)  # per process, checked before init
        self.device = distributed.init(pick_device(run.device))
        self.world = distributed.world_size()
        built = time.perf_counter()
        torch.manual_seed(run.seed)
        random.seed(run.seed)
        np.random.seed(run.seed)
        glue = run.task.kind == "glue"
        model, self.tok = (finetune if glue else pretrain).build(run)
        distributed.say(f"model {run.model}: {describe(model)}")
        self.data = (finetune.GlueData if glue else pretrain.LMData)(run, self.tok, self.device)
        if t.epochs:  # the budget in passes over the training set
            steps = t.epochs * self.data.steps_per_epoch
            self.run = run = run.model_copy(update={"train": t.model_copy(update={"steps": steps})})
            t = run.train
        self.method = build_method(run)
        self.model = self.method.prepare(model.to(self.device), run)
        self.offloader = memory.apply(self.model, run.memory, self.device)
        # forward and loss in one graph; the model itself, its state_dict and hooks unchanged
        self.loss = torch.compile(self.data.loss) if t.compile else self.data.loss
        self.precision = Precision(t, self.device)
        self.offloaded = 0  # activation bytes moved to the host, over the steps run here
        self.optimizer = self.method.optimizer(self.model, run)
        self.build_s = time.perf_counter() - built  # model, method and optimizer: not launching
        self.first_step_at: float | None = None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: self.method.lr_factor(s, run)
        )
        self.step, self.tokens = 0, 0
        self.last_eval: dict[str, float] = {}
        self.best: dict[str, float] = {}  # fine-tuning: the evaluation with the best score
        self.eval_every = run.eval.every or (self.data.steps_per_epoch or 0)  # glue: per epoch
        self.costs: dict[str, Any] = {}
        self._resume()
        self.layerwise = getattr(self.optimizer, "layerwise", False)
        self._wrap()
        self.meter = meter.Meter(self.device)
        self.flops_per_token = meter.flops_per_token(self.model, run.task.seq_len)
        self.first_step = self.step
        self.after_step: Callable[[], Any] | None = None  # profiling (--profile, bench memory)

    def _resume(self) -> None:
        state = self.rec.load_checkpoint()
        if state is None:
            self.rec.truncate_metrics(0)  # a start from scratch owns no earlier lines
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.restore(state["data"])
        set_rng_state(state["rng"])
        self.step, self.tokens = state["step"], state["tokens"]
        self.last_eval, self.costs, self.best = state["last_eval"], state["costs"], state["best"]
        self.precision.load_state_dict(state["precision"])
        self.rec.truncate_metrics(self.step)
        distributed.say(f"resumed from {self.rec.ckpt_path} at step {self.step}")

    def _wrap(self) -> None:
        """`net` is what forward runs through: DDP, or the model itself (one process, or
        layer-wise). Wrapped again when ReLoRA's warm start freezes weights DDP waits for."""
        self.net = distributed.wrap(self.model, self.device, self.layerwise)
        self._trainable = distributed.trainable(self.model)

    def _settle(self) -> None:
        """fp16: an event line for each step skipped since the last read."""
        for step in self.precision.settle():
            self.rec.log({"kind": "event", "step": step, "skipped": "overflow"})

    def save(self) -> None:
        """Rank 0 writes the bare model's state: the same checkpoint as one process's."""
        distributed.check_same(self.model, self.step)
        self._settle()
        self.rec.save_checkpoint(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "data": self.data.state(),
                "rng": rng_state(),
                "step": self.step,
                "tokens": self.tokens,
                "last_eval": self.last_eval,
                "best": self.best,
                "costs": self.costs,
                "precision": self.precision.state_dict(),
            }
        )

    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns this rank's share of the step's mean loss."""
        micro, tokens = zip(*(self.data.next() for _ in range(self.accumulation)), strict=True)
        self.step_tokens = sum(tokens) * self.world
        targets = sum(self.data.count(batch) for batch in micro)
        targets = distributed.all_sum(targets)  # the whole step's, over every rank
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            last = i == len(micro) - 1
            if self.layerwise:  # updates run inside backward: only once the gradient is complete
                self.optimizer.sync = last
            # DDP reduces in the last micro-batch's backward only; before it, gradients add up
            wait = self.net.no_sync() if self.net is not self.model and not last else nullcontext()
            with wait:
                with self.precision.autocast():
                    loss = self.loss(self.net, batch)
                self.precision.backward(loss * self.world / targets)  # × W undoes DDP's average
            total += loss.detach()
        clip = None if self.layerwise else self.run.train.grad_clip  # layer-wise: per parameter
        grads = clip or self.precision.scaler is not None  # fp16 checks their norm
        params = [p for p in self.model.parameters() if p.grad is not None] if grads else []
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.precision.step(self.optimizer, params, clip, self.step + 1)
        self.scheduler.step()
        if self.offloader is not None:
            self.offloaded += self.offloader.take_bytes()
        events = self.method.on_step(self.step + 1, self.model, self.optimizer)
        if events:
            self.rec.log({"kind": "event", "step": self.step + 1, **events})
            distributed.say(f"step {self.step + 1}: {events}")
        if not self.costs:  # gradients and states exist now: count them once
            self.costs = meter.breakdown(self.method, self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.net is not self.model and distributed.trainable(self.model) != self._trainable:
            self._wrap()
        return total / targets

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        try:
            return self.data.evaluate(self.model, self.precision)
        finally:
            self.model.train()

    def fit(self) -> str:
        t, steps = self.run.train, self.run.train.steps
        running = torch.zeros((), device=self.device)
        self.model.train()
        self.meter.resume()
        first = self.first_step = self.step
        self.first_step_at = time.time()  # `harness bench launch`: launch → training
        while self.step < steps:
            loss = self.train_step()
            running += loss
            self.step += 1
            self.tokens += self.step_tokens
            self.meter.add(self.step_tokens)
            if self.after_step is not None:
                self.after_step()
            if self.step == first + 1:  # the first step pays one-off costs: not steady state
                self.meter.lap(steady=steps == first + 1)
            if self.step % t.log_every == 0 or self.step == steps:
                self._log(*distributed.all_sum(torch.stack([loss, running])))  # global losses
                running.zero_()
            eval_due = self.eval_every and self.step % self.eval_every == 0
            if eval_due or self.step == steps:
                self._eval()
            stop = distributed.any_rank(self.should_stop(self.step), self.device)
            if (
                stop
                or self.step == steps
                or (t.checkpoint_every and self.step % t.checkpoint_every == 0)
            ):
                self.meter.pause()
                self.save()
                self.meter.resume()
            if stop and self.step < steps:
                return "interrupted"
        return "ok"

    def _log(self, loss: torch.Tensor, running: torch.Tensor) -> None:
        seconds, tps = self.meter.lap()
        self._settle()
        if not torch.isfinite(running):
            raise NonFinite(f"loss is {float(running)} by step {self.step}")
        lr, value = self.lr, float(loss)
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
                **self.precision.log(),
            }
        )
        distributed.say(
            f"step {self.step}/{self.run.train.steps} loss {value:.4f} lr {lr:.2e} "
            f"tok/s {tps:,.0f}"
        )

    def _eval(self) -> None:
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
        if self.step >= self.run.train.steps:
            return
        prune = bool(self.prune and distributed.is_main() and self.prune(self.step, self.last_eval))
        if distributed.any_rank(prune, self.device):  # rank 0 asks the study; all obey
            raise Pruned(f"pruned by the study at step {self.step}")

    def results(self) -> dict[str, Any]:
        tps = self.meter.tokens_per_s
        peak = meter.peak_flops(self.device, self.run.train.precision)
        self._settle()
        mfu = tps * self.flops_per_token / peak if tps and peak else None
        return {
            "step": self.step,
            "steps": self.run.train.steps,
            "tokens": self.tokens,
            "build_s": self.build_s,
            "first_step_at": self.first_step_at,
            **self.last_eval,
            **self.best,
            "tokens_per_s": tps,
            "mfu": mfu,
            **self.precision.log(),
            **self._offloaded(),
            **self.costs,
            **meter.peak_memory(self.device),
        }

    def _offloaded(self) -> dict[str, float]:
        """Activation bytes moved to the host per step: what offload took off the device."""
        ran = self.step - self.first_step
        if self.offloader is None or ran <= 0:
            return {}
        return {"offloaded_bytes_per_step": self.offloaded / ran}

    def close(self) -> None:
        self.data.close()




