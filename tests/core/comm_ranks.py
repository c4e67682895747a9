"""YaliCommunicator start-up on N real gloo ranks, each in its own process: what every rank got."""
import os

import torch

from benchmarks.common.processes import launch_ranks


def _rank(rank, port, env, devices, world_size, stand_in, q):
    import torch.distributed as dist

    os.environ.update(env.get(rank, {}))
    device = (devices or {}).get(rank, torch.device("cuda", rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if stand_in is not None:  # GPU stand-ins (gpu_stand_in.py), this rank failing the step stand_in[rank]
        from tests.core import gpu_stand_in

        gpu_stand_in.install({world_size: dist.group.WORLD}, world_size, stand_in.get(rank))
    from yali_vllm.communicator import YaliCommunicator, YaliUnavailable

    try:
        YaliCommunicator(dist.group.WORLD, device)
        q.put((rank, "created"))
    except YaliUnavailable as e:
        q.put((rank, f"unavailable: {e}"))
    except Exception as e:  # anything else is a bug
        q.put((rank, f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()


def start_ranks(world_size: int = 2, env: dict | None = None, devices: dict | None = None,
                timeout: float = 200, stand_in: dict | None = None) -> dict:
    """Every rank's outcome: "created", "unavailable: <reason>" or "<Error>: <message>". `env`
    and `devices` map a rank to its environment additions and its device argument (default
    cuda:<rank>). `stand_in` (a dict, maybe empty): the GPU-only parts stood in
    (tests/core/gpu_stand_in.py), mapping a rank to the step it fails. Fails the test when a rank
    did not report in time (a hang)."""
    got, _ = launch_ranks(_rank, (env or {}, devices, world_size, stand_in), timeout, world_size=world_size)
    assert len(got) == world_size, f"a rank hung in YaliCommunicator start-up (reported: {got})"
    return got
