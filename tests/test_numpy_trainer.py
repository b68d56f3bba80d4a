"""The numpy trainer: one step equals torch's autograd SGD step, a simulated numpy course
equals the torch course, and a deployed course mixing torch and numpy clients (real
processes) ends with the all-torch course's final model."""
import numpy as np
import pytest
import torch

from fedcore.kernel.batch_order import NumpyBatchStream
from fedcore.kernel.contract import BatchStream
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.execution.numpy_trainer import NumpyLogRegTrainer
from tests.conftest import small_cfg
from tests.deploy_helpers import server_port, text, wait_exit, write_cfg

ALIGNED = {"model.dtype": "float64", "train.shuffle": "numpy"}


def test_one_step_is_torch_sgd_on_the_mean_cross_entropy():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(7, 5)), rng.integers(0, 4, size=7)
    w0, b0 = rng.normal(size=(4, 5)), rng.normal(size=4)
    cfg = small_cfg(train__optimizer__lr=0.3)
    t = NumpyLogRegTrainer({"1.weight": w0, "1.bias": b0}, cfg, store=None)
    loss = t.step(x, y)

    lin = torch.nn.Linear(5, 4).double()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w0))
        lin.bias.copy_(torch.from_numpy(b0))
    opt = torch.optim.SGD(lin.parameters(), lr=0.3)
    ref = torch.nn.functional.cross_entropy(lin(torch.from_numpy(x)), torch.from_numpy(y))
    ref.backward()
    opt.step()
    assert loss == pytest.approx(ref.item(), abs=1e-12)
    np.testing.assert_allclose(t.w, lin.weight.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(t.b, lin.bias.detach().numpy(), rtol=0, atol=1e-12)


def test_numpy_shuffle_gives_both_streams_the_same_batches():
    a, b = BatchStream(23, 5, 7, 2, 1, 10, shuffle="numpy"), NumpyBatchStream(23, 5, 7, 2, 1, 10)
    for _ in range(12):   # across epoch boundaries
        assert a.next().tolist() == b.next().tolist()
    assert a.position() == b.position()


def test_simulated_numpy_course_equals_the_torch_course(tmp_path):
    finals = {}
    for backend in ("torch", "numpy"):
        cfg = small_cfg(tmp_path / backend, **{k.replace(".", "__"): v for k, v in ALIGNED.items()},
                        train__backend=backend, federate__total_round_num=3)
        Course(cfg).run()
        finals[backend] = torch.load(tmp_path / backend / "final_model.pt", weights_only=True)
    for name, t in finals["torch"].items():
        assert t.dtype == torch.float64
        assert torch.allclose(finals["numpy"][name], t, rtol=0, atol=1e-10), name


@pytest.mark.parametrize("bad", [{"train.optimizer.momentum": 0.9}, {"model.type": "mlp"},
                                 {"train.shuffle": "torch"}, {"executor": "processes"}])
def test_what_the_numpy_trainer_cannot_do_is_refused(bad):
    overrides = {**ALIGNED, "train.backend": "numpy", **bad}
    with pytest.raises(ConfigError, match="train.backend"):
        small_cfg(**{k.replace(".", "__"): v for k, v in overrides.items()})


@pytest.mark.slow
def test_deployed_course_mixing_torch_and_numpy_clients(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {**ALIGNED, "distribute.insecure": True,
                                               "distribute.token": "t", "federate.total_round_num": 2,
                                               "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "deployed"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.client_id={k}",
                             f"distribute.server_port={port}", f"train.backend={backend}")
               for k, backend in ((1, "torch"), (2, "numpy"), (3, "numpy"))]
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    for c in clients:
        assert wait_exit(c, 60) == 0, text(c)[-2000:]

    sim = tmp_path / "all_torch"
    Course(small_cfg(sim, federate__client_num=3, model__dtype="float64", train__shuffle="numpy")).run()
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim / "final_model.pt", weights_only=True)
    assert deployed.keys() == simulated.keys()
    for name in simulated:
        assert torch.allclose(deployed[name], simulated[name], rtol=0, atol=1e-6), name
