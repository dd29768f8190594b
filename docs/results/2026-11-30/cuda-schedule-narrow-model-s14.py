#!/usr/bin/env python3
# Fourteenth session: the 8x512_zipf tail if some units could run as two 128-column halves at a
# cost factor r each (r = 1.0: as fast per flop as a whole unit), greedy and by bisection on the
# makespan with first-fit. Unit costs from the thirteenth/fourteenth sessions traces. python3 this.py
import heapq, itertools
def units():
    u=[1.0]*96+[1.0]*4+[0.90]*24+[0.84]*8+[0.80]*8
    return sorted(u,reverse=True)
def lpt(costs, m=66):
    h=[(0.0,i) for i in range(m)]; heapq.heapify(h)
    for c in sorted(costs,reverse=True):
        l,i=heapq.heappop(h); heapq.heappush(h,(l+c,i))
    return max(l for l,_ in h)
for r in [1.0,1.1,1.2,1.4]:
    best=None
    u=units()
    for nhalf in range(0,len(u)+1):
        # split the nhalf smallest units into narrow halves
        whole=u[:len(u)-nhalf]; halves=[x*0.5*r for x in u[len(u)-nhalf:] for _ in (0,1)]
        # place whole LPT then halves LPT
        h=[(0.0,i) for i in range(66)]; heapq.heapify(h)
        for c in whole+sorted(halves,reverse=True):
            l,i=heapq.heappop(h); heapq.heappush(h,(l+c,i))
        ms=max(l for l,_ in h)
        if best is None or ms<best[0]: best=(ms,nhalf)
    print("narrow cost factor",r,"best makespan %.3f with %d units halved"%best, "avg %.3f"%(sum(u)/66))
def feasible(T,u,r,m=66,parts=2):
    bins=[0.0]*m
    for c in sorted(u,reverse=True):
        # best fit whole
        cand=[i for i in range(m) if bins[i]+c<=T+1e-9]
        if cand:
            i=max(cand,key=lambda i:bins[i]); bins[i]+=c; continue
        ok=False
        for p in range(2,parts+1):
            piece=c/p*r
            b2=bins[:]
            good=True
            for _ in range(p):
                cand=[i for i in range(m) if b2[i]+piece<=T+1e-9]
                if not cand: good=False;break
                i=max(cand,key=lambda i:b2[i]); b2[i]+=piece
            if good: bins=b2; ok=True;break
        if not ok: return False
    return True
for r in [1.0,1.05,1.1,1.2,1.4]:
  for parts in [2,4]:
    lo,hi=2.0,3.0
    for _ in range(40):
        mid=(lo+hi)/2
        if feasible(mid,units(),r,parts=parts): hi=mid
        else: lo=mid
    print("bisect: narrow factor",r,"parts<=",parts,"makespan %.3f"%hi)
