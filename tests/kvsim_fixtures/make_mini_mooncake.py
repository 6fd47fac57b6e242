"""Writes mini_mooncake.jsonl: a small Mooncake-format trace of multi-turn conversations.

Run from the repo root: python tests/kvsim_fixtures/make_mini_mooncake.py
Every request starts with the shared block 0 (as in the real trace); each turn of a
conversation extends the previous turn's blocks, so ids are prefix-chained.
"""

import json
import math
import random
from pathlib import Path


def main() -> None:
    rng = random.Random(5)
    next_id = 1
    convs = []  # (hash_ids, input_length)
    lines = []
    t_ms = 0
    for _ in range(240):
        t_ms += rng.choice((0, 0, 3000))
        if convs and rng.random() < 0.6:
            i = rng.randrange(len(convs))
            ids, n = convs[i]
            n_new = n + rng.randint(200, 3000)
        else:
            ids, n, i = [0], 0, None
            n_new = rng.randint(600, 9000)
        full = n // 512  # the partial tail block's id changes as the text grows
        ids = ids[: max(full, 1)]  # block 0 (the shared first block) always stays
        while len(ids) < math.ceil(n_new / 512):
            ids.append(next_id)
            next_id += 1
        if i is None:
            convs.append((ids, n_new))
        else:
            convs[i] = (ids, n_new)
        rec = {"timestamp": t_ms, "input_length": n_new, "output_length": rng.randint(1, 400), "hash_ids": ids}
        lines.append(json.dumps(rec))
    Path(__file__).with_name("mini_mooncake.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
