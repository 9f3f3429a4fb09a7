"""The pretraining loss (harness/train/lm_loss.py) against the formula it replaced: F.cross_entropy
on the sliced, float32-cast logits; what it keeps for backward; its wiring into training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_two_processes_train_as_one, micro_model, micro_run, train_losses

from harness.data.loader import IGNORE
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.train import lm_loss, train

VOCAB, HIDDEN = 300, 24


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss as pretrain.loss_sum computed it before: logits sliced, then cast to float32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE, reduction="sum")


def labels_with_ignored(batch: int = 3, seq: int = 19) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (batch, seq))
    labels[0, 4:9] = IGNORE  # padding inside a sequence, and a whole ignored tail
    labels[2, 12:] = IGNORE
    return labels


# precision -> (dtype of the logits' inputs, autocast on)
PRECISIONS = {"32-true": (torch.float32, False), "bf16-mixed": (torch.float32, True),
              "bf16-true": (torch.bfloat16, False)}


def head_case(precision: str, seed: int = 0):
    torch.manual_seed(seed)
    dtype, _ = PRECISIONS[precision]
    hidden = (torch.randn(3, 19, HIDDEN) * 2).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN).to(dtype).requires_grad_()
    return hidden, weight, labels_with_ignored()


def losses_and_grads(precision, loss_of):
    """`loss_of(hidden, weight, labels)`'s value and gradients, with autocast as `precision`
    sets it; the output is scaled, as a loop's division by the target count does."""
    hidden, weight, labels = head_case(precision)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=PRECISIONS[precision][1]):
        loss = loss_of(hidden, weight, labels)
    return loss, torch.autograd.grad(loss * 0.37, (hidden, weight))


def old_formula(hidden, weight, labels):
    return reference(F.linear(hidden, weight), labels)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# Gradients against the old formula's, relative to their largest element. The softmax is
# exp(logit - lse) in both, and lse (about 5 to 10 here) carries float32's rounding: 1e-6 of
# an element is its floor. Measured over 20 seeds: float32 at most 2.3e-6; bfloat16 logits'
# gradients 1.0e-5 (an element a bfloat16 rounding apart where the float32 values straddle
# one); bfloat16 head weight's, summed over chunks in float32 from each chunk's bfloat16
# product where one matmul rounded the sum once, 7.6e-3 (57 chunks of 1 token).
GRAD_TOLERANCE = {"32-true": 4e-6, "bf16-mixed": 4e-6, "bf16-true": 4e-5}
CHUNKED_WEIGHT_TOLERANCE = {"32-true": 4e-6, "bf16-mixed": 2**-6, "bf16-true": 2**-6}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_loss_on_logits_equals_the_old_formula_with_its_gradient(precision):
    """The loss within 1e-6 (measured 3e-7); its gradient in the logits' dtype."""
    hidden, weight, labels = head_case(precision)
    logits = F.linear(hidden, weight).detach().requires_grad_()
    new, old = lm_loss.cross_entropy_sum(logits, labels), reference(logits, labels)
    (grad,) = torch.autograd.grad(new * 0.37, logits)
    (old_grad,) = torch.autograd.grad(old * 0.37, logits)
    assert abs(new.item() / old.item() - 1) <= 1e-6
    assert grad.dtype == logits.dtype and relative(grad, old_grad) <= GRAD_TOLERANCE[precision]
    assert not grad[0, 3:8].any()  # ignored targets (labels 4-8, shifted): no gradient


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_chunked_loss_equals_the_old_formula_with_its_gradients(precision, chunk):
    """Chunks of 1, 7 (not dividing the 57 tokens), 16 and more than all of them, under
    autocast where bf16-mixed has it: the loss within 1e-6, the hidden state's and the head
    weight's gradients in their dtypes."""
    new, (dh, dw) = losses_and_grads(
        precision, lambda h, w, y: lm_loss.linear_cross_entropy_sum(h, w, y, chunk))
    old, (oh, ow) = losses_and_grads(precision, old_formula)
    assert abs(new.item() / old.item() - 1) <= 1e-6
    assert dh.dtype == oh.dtype and dw.dtype == ow.dtype
    assert relative(dh, oh) <= GRAD_TOLERANCE["32-true"]
    assert relative(dw, ow) <= CHUNKED_WEIGHT_TOLERANCE[precision]


def saved_bytes(loss_of, *inputs) -> dict[tuple[int, ...], int]:
    """Bytes of the distinct tensors autograd saves for backward while `loss_of` runs, by
    shape (a tensor two ops save counts once)."""
    saved: dict[tuple[int, ...], int] = {}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            saved[tuple(t.shape)] = saved.get(tuple(t.shape), 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(*inputs)
    return saved


def test_the_loss_keeps_the_logits_once_in_their_dtype_and_a_float32_lse():
    """bfloat16 logits of 57 tokens: the old formula kept a float32 log-softmax (4 bytes a
    logit) beside what made it; the new keeps the logits as they are (2 bytes a logit, the
    same tensor the caller holds) and 4 bytes a token."""
    logits = torch.randn(3, 19, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    labels = labels_with_ignored()
    new = saved_bytes(lm_loss.cross_entropy_sum, logits, labels)
    assert new[(57, VOCAB)] == 2 * 57 * VOCAB and new[(57,)] == 4 * 57 + 8 * 57  # lse, targets
    assert sum(new.values()) == 2 * 57 * VOCAB + 12 * 57
    old = saved_bytes(reference, logits, labels)
    assert old[(54, VOCAB)] == 4 * 54 * VOCAB  # the float32 log-softmax of the sliced logits


def test_the_chunked_loss_keeps_no_logits_at_all():
    """Only the hidden state, the weight, the targets and the lse: no vocabulary-wide tensor."""
    hidden, weight, labels = head_case("32-true")
    saved = saved_bytes(lambda h, w, y: lm_loss.linear_cross_entropy_sum(h, w, y, 8),
                        hidden, weight, labels)
    assert sum(saved.values()) == 4 * (57 * HIDDEN + VOCAB * HIDDEN) + 8 * 57 + 4 * 57


def test_the_chunked_loss_peak_grows_with_the_chunk_not_the_tokens():
    """The profiler's live-tensor peak of a chunked loss's forward and backward above its
    inputs: from 512 tokens to 2048 it grows by the hidden state's gradient only (2048 x 64 x
    4 bytes less 512's), not by the logits (1536 more tokens x 8192 x 4 bytes, 50 MB)."""
    from torch.profiler import ProfilerActivity, profile

    from harness.cost.tensor_peak import _peak, _timeline

    def peak(tokens: int) -> int:
        torch.manual_seed(0)
        hidden = torch.randn(tokens // 128, 128, 64)
        weight = torch.randn(8192, 64, requires_grad=True)
        labels = torch.randint(0, 8192, (tokens // 128, 128))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            h = hidden.clone().requires_grad_()
            lm_loss.linear_cross_entropy_sum(h, weight, labels, 64).backward()
        return _peak(_timeline(prof))[0] - 2 * hidden.numel() * 4  # less the input and its grad

    small, large = peak(512), peak(2048)
    assert large - small <= 1536 * 64 * 4 + 64 * 1024  # the targets and lse, a few kB
    assert large - small < 1536 * 8192 * 4 / 100


def model_losses(model, loss, from_hidden, ids, labels):
    params = [p for p in model.parameters() if p.requires_grad]
    value = lm_loss.next_token_loss(model, ids, labels, loss, from_hidden)
    return value, torch.autograd.grad(value, params)


def qwen2_tied():
    """A small Qwen2 (grouped-query attention, biased q/k/v, head tied to the embedding)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def llama_tied():
    model = micro_model()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("build", [micro_model, llama_tied, qwen2_tied],
                         ids=["llama_micro", "llama_micro tied", "qwen2 tied"])
def test_a_model_gives_the_same_loss_and_gradients_from_its_hidden_state(build):
    """A head separate or tied to the embedding: loss_chunk 16 reads the last hidden state (the
    head's input, taken in a forward where the head gets no tokens) and the head's weight; the
    forward leaves no hook behind."""
    model = build()
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    labels = ids.clone()
    labels[1, 20:] = IGNORE
    logits = model(input_ids=ids).logits
    old = reference(logits, labels)
    old_grads = torch.autograd.grad(old, [p for p in model.parameters() if p.requires_grad])
    for chunk in (0, 16):
        loss, from_hidden = lm_loss.head_loss(chunk, "torch")
        assert from_hidden == (chunk > 0)
        new, grads = model_losses(model, loss, from_hidden, ids, labels)
        assert abs(new.item() / old.item() - 1) <= 1e-6
        assert max(relative(g, o) for g, o in zip(grads, old_grads, strict=True)) <= 1e-6
    assert not model.lm_head._forward_pre_hooks


def test_a_model_whose_logits_are_not_its_heads_matmul_is_refused_in_one_line():
    model = micro_model()
    model.config.final_logit_softcapping = 30.0
    loss, _ = lm_loss.head_loss(16, "torch")
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(UserError, match=r"sets final_logit_softcapping\); use loss_chunk 0"):
        lm_loss.next_token_loss(model, ids, ids, loss, True)


def test_liger_is_refused_on_the_cpu_and_given_the_hidden_state_and_shifted_targets(monkeypatch):
    """Without CUDA liger refuses in one line; where it runs, its fused loss gets the flat
    hidden state, the head weight and the shifted flat targets (a stand-in here)."""
    with pytest.raises(UserError, match="kernels: liger runs Triton kernels on CUDA"):
        lm_loss.head_loss(0, "liger")
    got = {}

    def fused():
        def loss(hidden, weight, targets):
            got.update(hidden=hidden.shape, targets=targets)
            return F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE,
                                   reduction="sum")
        return loss

    monkeypatch.setattr(lm_loss, "liger_linear_cross_entropy", fused)
    model = micro_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    loss, from_hidden = lm_loss.head_loss(0, "liger")
    value = lm_loss.next_token_loss(model, ids, ids, loss, from_hidden)
    assert got["hidden"] == (64, model.config.hidden_size)
    assert got["targets"].tolist() == [*ids[0, 1:], IGNORE, *ids[1, 1:], IGNORE]
    assert abs(value.item() / reference(model(input_ids=ids).logits, ids).item() - 1) <= 1e-6


@pytest.mark.parametrize("chunk", [0, 16])
def test_the_head_loss_traces_without_graph_breaks(chunk):
    """What train.compile compiles (fullgraph) after the model: one graph, no breaks."""
    model = micro_model()
    loss, from_hidden = lm_loss.head_loss(chunk, "torch")
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    hidden = model.model(input_ids=ids).last_hidden_state
    inputs = (hidden, model.lm_head.weight, ids) if from_hidden else (
        model.lm_head(hidden), ids)
    explained = torch._dynamo.explain(loss)(*inputs)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_training_with_loss_chunk_gives_the_same_losses(tmp_path, monkeypatch):
    """llama_micro, 3 steps of 2 x 32 tokens: loss_chunk 16 runs the chunked loss in training
    and evaluation and logs the losses of loss_chunk 0 and the same eval loss."""
    chunks = []

    def spy(hidden, weight, labels, chunk):
        chunks.append(chunk)
        return linear(hidden, weight, labels, chunk)

    linear = lm_loss.linear_cross_entropy_sum
    monkeypatch.setattr(lm_loss, "linear_cross_entropy_sum", spy)
    summaries, losses = {}, {}
    for chunk in (0, 16):
        run = load_run(micro_run(steps=3, loss_chunk=chunk))
        summaries[chunk] = train(run, tmp_path / str(chunk))
        losses[chunk] = train_losses(tmp_path / str(chunk))
    assert set(chunks) == {16} and len(chunks) > 3 * 2  # 2 micro-batches a step, and eval
    assert losses[0].keys() == losses[16].keys() == {1, 2, 3}
    for step, loss in losses[0].items():
        assert abs(losses[16][step] / loss - 1) <= 1e-5
    assert abs(summaries[16]["eval_loss"] / summaries[0]["eval_loss"] - 1) <= 1e-5


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_with_loss_chunk_train_as_one(tmp_path, parallel):
    """The chunked loss reads the head's weight outside the model's forward: DDP still reduces
    its gradient (the forward ran through DDP's wrapper), and under fsdp the root's gathered
    weight is the one read and its gradient is reduce-scattered; 2 ranks log one process's
    losses."""
    data = micro_run(steps=3, total_batch_size=8, loss_chunk=16, parallel=parallel)
    assert_two_processes_train_as_one(data, tmp_path)
