"""Regenerate tests/data/gfc_golden.json from the reference implementation.

    python tests/data/make_gfc_golden.py   # needs pygfc==1.1.0

Cases span n from 1 to just below 2**64, rounds 0-10 and seeds across the
64-bit range.  Cases where gfc's double-precision square root gives a grid
too small for n (gfc.h explains why tokload differs there) are left out: on
those, pygfc is not a permutation and tokload deliberately differs.
"""

import json
import math
import random
from pathlib import Path

import pygfc


def gfc_grid_side(n: int) -> int:
    return math.ceil(math.sqrt(float(n)))


def main() -> None:
    rng = random.Random(20261122)
    ns = [
        1,
        2,
        3,
        4,
        5,
        10,
        16,
        17,
        100,
        255,
        256,
        257,
        1000,
        4096,
        65535,
        65536,
        65537,
        10**6,
        10**7,
        268_554_297,
        2**32 - 1,
        2**32,
        2**32 + 1,
        10**12,
        2**48,
        10**15,
        2**52,
        2**53 - 1,
        2**62,
        2**63 - 25,
        2**63,
        2**64 - 1,
    ]
    ns += [rng.randrange(1, 2**k) for k in range(4, 65, 3)]
    cases = []
    for n in ns:
        a = gfc_grid_side(n)
        if a * a < n:
            continue  # gfc is not a bijection here (docs/permutation.md 7.1)
        for rounds, seed in [
            (6, 0),
            (6, 42),
            (8, 2**63 + 5),
            (rng.choice([0, 1, 2, 3, 4, 5, 7, 10]), rng.randrange(2**64)),
        ]:
            p = pygfc.Permutation(n, rounds, seed)
            idx = sorted({0, n - 1, n // 2, *(rng.randrange(n) for _ in range(12))})
            cases.append(
                {
                    "n": n,
                    "rounds": rounds,
                    "seed": seed,
                    "indices": idx,
                    "values": [p[i] for i in idx],
                    "inverse_of": idx,
                    "inverse": [p.inv(i) for i in idx],
                }
            )
    out = {"generator": f"pygfc {getattr(pygfc, '__version__', '1.1.0')}", "cases": cases}
    path = Path(__file__).with_name("gfc_golden.json")
    path.write_text(json.dumps(out, indent=0) + "\n")
    print(f"wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
