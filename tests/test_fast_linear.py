"""Generation's oneDNN-packed linear layers: the same products as PyTorch's, only while generating, never
stale after a weight change, and dropped when the backend's lock is taken."""

from __future__ import annotations

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
