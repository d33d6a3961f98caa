"""torchrun worker (2 ranks, gloo): ``sync_generator``'s pass protocol with a collective export.

    torchrun --nproc-per-node 2 tests/unit/utils/stream_worker.py OUT.json

Rank 1 sends every tensor that rank 0's export yields (point to point, as a later pipeline stage does). Rank 0's
generator misbehaves in three ways: it reads part of a pass and then reads again (a failed transfer redone
through a folder), it raises after one tensor, and it raises before reading anything. Each scenario must end on
both ranks (no rank left waiting in a send), and rank 0 must see whole, fresh passes.
"""

import json
import sys

import torch
import torch.distributed as tdist

from nemo_rcgrpo.models.factory import sync_generator

N = 4


class Policy:
    export_is_collective = True
    device = torch.device("cpu")

    def __init__(self):
        self.rank, self.passes = tdist.get_rank(), 0

    def export_meta(self):
        return [(f"w{i}", (3,), torch.float32) for i in range(N)] if self.rank == 0 else None

    def export_weights(self):
        self.passes += 1
        for i in range(N):
            if self.rank == 0:
                t = torch.empty(3)
                tdist.recv(t, src=1)
                yield f"w{i}", t
            else:
                tdist.send(torch.full((3,), 10.0 * self.passes + i), dst=0)


class Generator:
    def __init__(self, behaviour):
        self.behaviour, self.seen = behaviour, []

    def update_weights(self, weights, version):
        if self.behaviour == "raise_at_once":
            raise RuntimeError("refused before reading")
        it = iter(weights)
        self.seen.append([float(next(it)[1][0])])
        if self.behaviour == "raise_after_one":
            raise RuntimeError("failed after one tensor")
        next(it)  # a second tensor, then the pass is abandoned and the weights read again
        self.seen.append([float(t[0]) for _, t in weights])


def main() -> None:
    tdist.init_process_group("gloo")
    rank, out = tdist.get_rank(), {}
    for behaviour in ("read_twice", "raise_after_one", "raise_at_once"):
        policy = Policy()
        generator = Generator(behaviour) if rank == 0 else None
        error = None
        try:
            sync_generator(policy, generator, False, 1)
        except RuntimeError as e:
            error = str(e)
        passes = [None, None]
        tdist.all_gather_object(passes, policy.passes)
        out[behaviour] = {"passes": passes, "error": error, "seen": generator.seen if generator else None}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
