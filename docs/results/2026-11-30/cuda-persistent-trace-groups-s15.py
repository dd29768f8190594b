#!/usr/bin/env python3
"""Unit durations by group and kind, with each unit's start time, from moonep-gemm-probe's raw trace
records (MOONEP_TRACE_DUMP; FILE.bin.sizes next to it). Same layout assumptions as
cuda-persistent-trace-units-s12.py (132 CTAs, 256 records of 6 words, K = 7168, n = 2048). A unit's
kind and group follow PersistentGemm's unit numbering with the 0.45 remainder rule; --force-swap
files (named *force*) transpose every remainder. Usage: python3 this.py FILE.bin [...]"""
import struct, sys
A=0.45
def c(n): return A+(1-A)*n/256
def prefers(r, force):
    rest=r%256
    if rest==0: return False
    if force: return True
    n=min(256,-(-rest//32)*32)
    return 8*c(n) < 0.98*(4 if rest<=128 else 8)
def kinds(sizes, force):
    k=[]
    for g,r in enumerate(sizes):
        if r==0: continue
        s=prefers(r, force)
        mt= r//256*2 if s else -(-r//128)
        k+=[(g,'full')]*((mt//2)*8)
        if s: k+=[(g,'swap%d'%min(256,-(-(r%256)//32)*32))]*8
        else: k+=[(g,'odd')]*((mt%2)*4)
    return k
for name in sys.argv[1:]:
    raw=open(name,'rb').read(); v=struct.unpack('<%dQ'%(len(raw)//8),raw)
    sizes=[int(x) for x in open(name+'.sizes').read().split()]
    kd=kinds(sizes,'force' in name)
    recs=[[v[(cc*256+i)*6:(cc*256+i)*6+6] for i in range(256)] for cc in range(132)]
    t0=min(r[1] for cc in recs for r in cc if r[1])
    dur={}
    for cc in recs:
        for r in cc:
            if r[1]==0: break
            s=(r[1]-t0)/1e3; e=(r[3]-t0)/1e3
            u=r[0]&0xFFFFFFFF; k0=(r[0]>>32)&0xFFFF; k1=(r[0]>>48)&0xFFF
            g,kind=kd[u]
            if not (k0==0 and k1==112): kind='part'
            dur.setdefault((g,kind),[]).append((s,e-s))
    print(name.split('/')[-1], 'sizes', sizes)
    for key in sorted(dur):
        d=sorted(x[1] for x in dur[key]); st=sorted(x[0] for x in dur[key])
        print('   group %2d %-8s n %4d dur med %.1f min %.1f max %.1f | start min %.0f med %.0f max %.0f'%(key[0],key[1],len(d),d[len(d)//2],d[0],d[-1],st[0],st[len(st)//2],st[-1]))
