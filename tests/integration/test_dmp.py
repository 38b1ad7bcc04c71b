"""TorchRec state through client.save / client.resume: an optimizer whose lazy state does not
exist yet is refused, naming what to call."""

from __future__ import annotations

import pytest

from trainer_client import RestoreError

pytestmark = [
    pytest.mark.torchrec,
    # fbgemm-gpu-cpu warns, on import, of GPU-only lookups it lacks and of its own module moves
    pytest.mark.filterwarnings("ignore::DeprecationWarning:fbgemm_gpu"),
]


def test_a_torchrec_optimizer_without_its_lazy_state_is_refused_naming_init_state(
    make_sidecar, make_client, job_name
):
    """client.save / client.resume without DCP (one process, TorchRec's KeyedOptimizer): a resume
    into an optimizer whose lazy state does not exist yet says what to call, not only
    "Different parameter count"."""
    from tests.fixtures import dlrm

    server = make_sidecar()
    model, opt = dlrm.build("plain")
    dlrm.train_step(model, opt, dlrm.batch(dlrm.Shape(), 0, 0))
    client = make_client(server, job_name)
    client.save(1, dlrm.state_of(model, opt)).result(30)

    model, opt = dlrm.build("plain", seed=1, init_state=False)
    other = make_client(server, job_name)
    with pytest.raises(RestoreError) as exc:
        other.resume(dlrm.state_of(model, opt))
    assert str(exc.value).startswith(
        "step 1 does not fit this state: state['optimizer']: the optimizer (CombinedOptimizer) has "
        "state for 2 parameters, the checkpoint for 10: create its state before resuming (TorchRec: "
        "optimizer.init_state();"
    )
    assert "Different parameter count: 2 vs 10" in str(exc.value)  # TorchRec's own words, kept
    opt.init_state()  # type: ignore[operator]
    assert other.resume(dlrm.state_of(model, opt)) == 1
