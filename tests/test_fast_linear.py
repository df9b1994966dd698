"""Generation's oneDNN-packed linear layers: the same products as PyTorch's, only while generating, never
stale after a weight change, and dropped when the backend's lock is taken."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from agl_trainer.generation import fast_linear

pytestmark = pytest.mark.skipif(
    not fast_linear.available(), reason="this PyTorch has no oneDNN packed linear"
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 300, bias=False)
    )


def test_packed_layers_compute_what_pytorch_does_and_only_inside_the_block():
    model = _model()
    x = torch.randn(16, 7, 256)
    with torch.no_grad():
        expected = model(x)
        packed = fast_linear.PackedLinears(lambda: model, rows=16, budget_bytes=2**30)
        with packed:
            assert all("forward" in layer.__dict__ for layer in (model[0], model[2]))
            got = model(x)
            with torch.enable_grad():  # training inside the block still takes PyTorch's own path
                assert model(x.requires_grad_()).grad_fn is not None
        assert all("forward" not in layer.__dict__ for layer in (model[0], model[2]))
    assert packed.nbytes >= (256 * 512 + 512 * 300) * 4
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_a_weight_changed_in_place_is_packed_again_and_release_drops_every_copy():
    model = _model()
    x = torch.randn(4, 256)
    packed = fast_linear.PackedLinears(lambda: model, budget_bytes=2**30)
    with torch.no_grad():
        with packed:
            model(x)
        model[0].weight.mul_(2.0)  # an optimizer step, in place
        expected = model(x)
        with packed:
            got = model(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)
    packed.release()
    assert packed.nbytes == 0


def test_packed_copies_stay_within_their_budget_largest_first():
    """Within the budget the largest weights are packed; the others still go through oneDNN, unpacked,
    and compute the same."""
    model = _model()  # weights of 512 KiB and 600 KiB
    x = torch.randn(5, 256)
    packed = fast_linear.PackedLinears(lambda: model, budget_bytes=700 * 1024)
    with torch.no_grad():
        expected = model(x)
        with packed:
            got = model(x)
            assert all("forward" in layer.__dict__ for layer in (model[0], model[2]))
    assert [[id(layer) for layer in layers] for layers, *_ in packed._packed.values()] == [[id(model[2])]]
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_small_weights_are_left_alone(tiny_policy):
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    backend = HFBackend(model, tokenizer, model_name="tiny")
    try:
        assert backend._linears is not None  # on by default on the CPU
        with torch.no_grad(), backend._linears:
            patched = [m for m in model.modules() if "forward" in m.__dict__]
        # the tiny model's 64-wide layers stay PyTorch's; its 49k-token output layer is packed
        assert patched == [model.lm_head] and backend._linears.nbytes > 0
        with backend.lock:  # someone may change the weights: the copies go
            assert backend._linears.nbytes == 0
        assert HFBackend(model, tokenizer, model_name="tiny", packed_linears=False)._linears is None
    finally:
        backend.close()


def test_the_backend_packs_within_the_budget_it_is_given(tiny_policy):
    """``packed_weights_mb`` (``serving.hf.packed_weights_mb``) is the copies' budget: 0 packs nothing (the
    layers still go through oneDNN), room for the output layer packs it; a negative budget is refused."""
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    size = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    for mb, expected in ((0.0, 0), (size / 2**20, size)):
        backend = HFBackend(model, tokenizer, model_name="tiny", packed_weights_mb=mb)
        try:
            assert backend._linears is not None
            with torch.no_grad(), backend._linears:
                assert "forward" in model.lm_head.__dict__
            assert backend._linears.nbytes == expected
        finally:
            backend.close()
    with pytest.raises(ValueError, match="packed_weights_mb must be 0"):
        HFBackend(model, tokenizer, model_name="tiny", packed_weights_mb=-1)


_bf16 = pytest.mark.skipif(
    not fast_linear.available(torch.bfloat16), reason="this PyTorch or CPU has no oneDNN bfloat16"
)


def _rounded(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """What a bfloat16 copy's product is: input and weight rounded, the result rounded, the bias after."""
    out = torch.nn.functional.linear(x.bfloat16(), layer.weight.bfloat16()).float()
    return out if layer.bias is None else out + layer.bias


@_bf16
def test_bfloat16_copies_round_weights_inputs_and_results_and_take_half_the_bytes():
    model = _model()
    x = torch.randn(16, 7, 256)
    packed = fast_linear.PackedLinears(lambda: model, rows=16, budget_bytes=2**30, dtype=torch.bfloat16)
    with torch.no_grad():
        exact = model(x)
        expected = _rounded(torch.nn.functional.gelu(_rounded(x, model[0])), model[2])
        with packed:
            got = model(x)
    assert got.dtype == torch.float32
    assert packed.nbytes == (256 * 512 + 512 * 300) * 2
    # within a bfloat16 step of the rounded model (kernels sum in their own order) ...
    assert torch.allclose(got, expected, atol=1e-2, rtol=1e-2)
    # ... and not the float32 model: the rounding is real
    assert not torch.allclose(got, exact, atol=1e-4, rtol=1e-4)


@_bf16
def test_a_layer_left_out_of_a_bfloat16_budget_multiplies_in_float32():
    model = _model()  # the 600 KiB float32 weight is 300 KiB in bfloat16, the 512 KiB one 256 KiB
    x = torch.randn(5, 256)
    packed = fast_linear.PackedLinears(lambda: model, budget_bytes=310 * 1024, dtype=torch.bfloat16)
    with torch.no_grad(), packed:
        first = model[0](x)
        second = model[2](torch.randn(5, 512))
    assert [[id(layer) for layer in layers] for layers, *_ in packed._packed.values()] == [[id(model[2])]]
    assert torch.allclose(first, torch.nn.functional.linear(x, model[0].weight, model[0].bias), atol=1e-5)
    assert second.dtype == torch.float32


def test_the_copies_dtype_is_float32_or_bfloat16():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fast_linear.PackedLinears(lambda: None, dtype=torch.float16)


def test_a_stacked_groups_members_called_one_by_one_share_one_product():
    """The forward pass calls a group's members one after the other on one input: the first computes the
    group's product, the others take their slices of it, and each slice is the member's own product."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(256, 512, bias=False)
            self.k = torch.nn.Linear(256, 256, bias=True)

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 1, 256)
    packed = fast_linear.PackedLinears(
        lambda: block, budget_bytes=2**30, groups=lambda model: [[model.q, model.k]]
    )
    products: list[int] = []
    multiply = packed.multiply_group

    def counting(layers: Any, inputs: torch.Tensor) -> bool:
        products.append(len(layers))
        return multiply(layers, inputs)

    packed.multiply_group = counting  # type: ignore[method-assign]
    with torch.no_grad(), packed:
        q, k = block.q(x), block.k(x)
        k_again = block.k(x)  # nothing ready for it any more: the group's product again
    assert products == [2, 2]
    with torch.no_grad():
        assert torch.allclose(q, block.q(x), atol=1e-5, rtol=1e-4)
        assert torch.allclose(k, block.k(x), atol=1e-5, rtol=1e-4)
        assert torch.allclose(k_again, k)


@_bf16
def test_the_backend_decodes_with_bfloat16_products_and_checks_its_direct_steps_at_their_rounding(
    tiny_policy,
):
    """``matmul_dtype="bfloat16"``: the packed copies are bfloat16, the direct step still agrees with the
    forward pass (both round alike), the logprobs are the rounded model's (close to, not equal to, the
    float32 backend's for the same tokens)."""
    from agl_core.gateway.backend import ChatRequest, Completion
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    request = ChatRequest(
        messages=[{"role": "user", "content": "Count to five, please. " * 4}], max_tokens=8, temperature=0.0
    )

    def complete(backend: HFBackend) -> Completion:
        async def run() -> Completion:
            events = [e async for e in backend.generate("tiny", request)]
            return next(e for e in events if isinstance(e, Completion))

        return asyncio.run(run())

    rounded = HFBackend(model, tokenizer, model_name="tiny", matmul_dtype="bfloat16")
    plain = HFBackend(model, tokenizer, model_name="tiny")
    try:
        assert rounded._linears is not None and rounded._linears.dtype == torch.bfloat16
        got, reference = complete(rounded), complete(plain)
        assert rounded._linears.nbytes == model.lm_head.weight.numel() * 2  # its one large layer
        if rounded._direct is not None:
            assert rounded._direct.enabled
        assert len(got.response_ids) == 8
        assert got.response_ids[0] == reference.response_ids[0]  # greedy, close logits: the same first token
        first = (got.response_logprobs[0], reference.response_logprobs[0])
        assert first[0] == pytest.approx(first[1], abs=0.1) and first[0] != first[1]
    finally:
        rounded.close()
        plain.close()


def test_the_backend_refuses_a_matmul_dtype_it_cannot_use(tiny_policy):
    from agl_trainer.generation.hf_backend import HFBackend

    model, tokenizer = tiny_policy
    with pytest.raises(ValueError, match="matmul_dtype must be one of float32, bfloat16, not 'float16'"):
        HFBackend(model, tokenizer, model_name="tiny", matmul_dtype="float16")
    with pytest.raises(ValueError, match="set matmul_dtype to float32"):
        HFBackend(model, tokenizer, model_name="tiny", matmul_dtype="bfloat16", packed_linears=False)
