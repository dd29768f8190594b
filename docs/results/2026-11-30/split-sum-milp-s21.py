#!/usr/bin/python3
"""Twenty-first session: the twentieth session's integer programs (cuda-schedule-milp-s20.py, whose
functions this script loads) for 8x512_zipf's best buildable plan (each split unit over a group of
2-4 clusters, parts sized to their room), with the transposed units priced at their cost inside the
launch (0.16 + 0.84 N / 256, the fourteenth session's trace) while the same remainders as today are
transposed (decided at the planner's 0.45), and split parts at the floors measured this session by
split-sum-probe-s21.cu: 2.9 us to publish a 128 KiB fp32 partial (plain stores and TMA alike) and
~1.0 us to read one (plain loads, L2-resident, nothing else running).
Needs Debian's python3-scipy: /usr/bin/python3 split-sum-milp-s21.py (a few minutes).
"""
import os

here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, "cuda-schedule-milp-s20.py")).read()
exec(src[:src.index("kd = kinds(sizes(8, 512))")])  # its functions and constants, not its runs


def kinds2(group_sizes, decide=0.45, price=0.16):  # which remainders transpose: decide; cost: price
    d = {}
    for rows in group_sizes:
        d[1.0] = d.get(1.0, 0) + rows // 256 * N_TILES
        rest = rows % 256
        if rest:
            n32 = ((rest + 31) // 32 * 32) / 256
            plain = N_TILES // 2 if rest <= 128 else N_TILES
            if N_TILES * (decide + (1 - decide) * n32) < 0.98 * plain:
                c = round(price + (1 - price) * n32, 6)
                d[c] = d.get(c, 0) + N_TILES
            else:
                d[1.0] = d.get(1.0, 0) + plain
    return d


k2 = kinds2(sizes(8, 512))
print(f"kinds at the in-launch price: {k2}, {sum(c * n for c, n in k2.items()):.2f} whole-unit times")
for pub, fix in ((3.5, 2.3), (2.9, 2.3), (2.9, 1.5), (2.9, 1.0), (2.0, 1.0), (0.0, 0.0)):
    T = bisect(groups_ok, k2, pub, fix)
    print(f"in-launch price, groups, publish {pub} us, read {fix} us: {T:.3f} -> {ratio(T):.3f}", flush=True)
T = bisect(groups_ok, kinds(sizes(8, 512)), 2.9, 1.0)
print(f"planner's price (0.45), groups, publish 2.9 us, read 1.0 us: {T:.3f} -> {ratio(T):.3f}", flush=True)
