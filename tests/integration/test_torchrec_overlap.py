"""TorchRec with the default (overlapped) staging: the step a save restores is the state at the
save call, bitwise, whichever way the tables are trained (fused TBE updates them inside
backward; in-backward optimizers step inside backward; KeyedOptimizerWrapper's own step hooks
never run)."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.torchrec,
    # TorchRec's apply_optimizer_in_backward is deprecated, and what it imports uses torch.jit.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

with warnings.catch_warnings():  # collection imports it before the marks apply
    warnings.simplefilter("ignore", DeprecationWarning)
    from tests.fixtures import dlrm


@pytest.mark.parametrize(
    ("kind", "tables"),
    [("plain", "adagrad"), ("fused", "sgd"), ("fused", "adagrad"), ("in_backward", "sgd")],
)
def test_a_restored_step_is_the_state_at_the_save_call(make_sidecar, make_client, job_name, kind, tables):
    server = make_sidecar()
    shape = dlrm.Shape()
    fused = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[tables]
    model, opt = dlrm.build(kind, shape, fused_optimizer=fused)
    client = make_client(server, job_name)
    state = dlrm.state_of(model, opt)
    client.resume(state)
    for i in range(2):
        dlrm.train_step(model, opt, dlrm.batch(shape, 0, i))
    expected = dlrm.snapshot(model, opt)
    client._sender.submit(time.sleep, 0.3)  # the background copy starts after the next step began
    handle = client.save(2, state)
    for i in range(2, 4):
        dlrm.train_step(model, opt, dlrm.batch(shape, 0, i))
    handle.durable.result(30)
    assert dlrm.snapshot(model, opt).keys() == expected.keys()

    fresh, fresh_opt = dlrm.build(kind, shape, seed=1, fused_optimizer=fused)
    assert client.restore(dlrm.state_of(fresh, fresh_opt)) == 2
    got = dlrm.snapshot(fresh, fresh_opt)
    assert got.keys() == expected.keys()
    torn = [k for k in expected if not _same(got[k], expected[k])]
    assert not torn, f"{kind}: restored step 2 differs from the state at save() in {torn}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise (NaN payloads and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
