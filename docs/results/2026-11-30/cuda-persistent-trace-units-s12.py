#!/usr/bin/env python3
"""Unit durations by kind from moonep-gemm-probe's raw trace records (MOONEP_TRACE_DUMP): whole
units, odd (a group's last 128-row tile as two column tiles), transposed units of N rows, and split
parts; and when the CTAs finished. Assumes the probe's H200 layout: 132 CTAs, 256 records of 6 words
each, K = 7168 (112 K-steps), n = 2048 (8 column tiles), the groups in the given order, and the
remainder rule of PersistentGemm::PrefersSwap with kSwapFixed = 0.45 (files named *noswap* were
recorded with set_swap(false)). Usage: python3 this.py FILE.bin [FILE.bin ...] (FILE.bin.sizes next
to each)."""
import struct, sys, math
A=0.45
def c(n): return A+(1-A)*n/256
def prefers(r):
    rest=r%256
    if rest==0: return False
    n=min(256,-(-rest//32)*32)
    return 8*c(n) < 0.98*(4 if rest<=128 else 8)
def kinds(sizes, swap):
    k=[]
    for r in sizes:
        if r==0: continue
        s= swap and prefers(r)
        mt= r//256*2 if s else -(-r//128)
        k+=['full']*((mt//2)*8)
        if s: k+=['swap%d'%min(256,-(-(r%256)//32)*32)]*8
        else: k+=['odd']*((mt%2)*4)
    return k
for name in sys.argv[1:]:
    raw=open(name,'rb').read(); v=struct.unpack('<%dQ'%(len(raw)//8),raw)
    sizes=[int(x) for x in open(name+'.sizes').read().split()]
    kd=kinds(sizes,'noswap' not in name)
    recs=[[v[(c*256+i)*6:(c*256+i)*6+6] for i in range(256)] for c in range(132)]
    t0=min(r[1] for cc in recs for r in cc if r[1])
    ends=[]; dur={}
    for cc in recs:
        last=0
        for r in cc:
            if r[1]==0: break
            s=(r[1]-t0)/1e3; e=(r[3]-t0)/1e3; last=e
            u=r[0]&0xFFFFFFFF; k0=(r[0]>>32)&0xFFFF; k1=(r[0]>>48)&0xFFF
            key=kd[u] if (k0==0 and k1==112) else 'part'
            dur.setdefault(key,[]).append(e-s)
        ends.append(last)
    ends.sort()
    print(name.split('/')[-1],'units',len(kd),'ends min %.0f p10 %.0f med %.0f p90 %.0f max %.0f'%(ends[0],ends[13],ends[66],ends[118],ends[-1]))
    for k in sorted(dur):
        d=sorted(dur[k]); print('   %-8s n %4d med %.1f p10 %.1f p90 %.1f'%(k,len(d),d[len(d)//2],d[len(d)//10],d[len(d)*9//10]))
