"""A model of the Hopper forward's pipeline protocol for one block (fwd_mainloop.h): a producer, two consumer
warpgroups, K / V stages, Q slabs and the slot ring as parity-waited mbarriers, TMA loads landing in any order, the
agents interleaved at random. Tiles are those of step 62's failing case (d 256, sq 1023, sk 300, causal): each a
(n_min, n_max, per-warpgroup n_max) or None (no visible key). Reports, per mode, runs that finished, read a wrong
block, over-arrived on a barrier or deadlocked:
  old: the producer arrives on the empty barriers for warpgroups that skip a block, and they do not wait on it
  new: every warpgroup waits for every block, skipped ones too, and releases it itself
A warpgroup is one agent here: the model cannot show the hang of warps within one warpgroup diverging (step 62).
    python3 benchmarks/dev/sim_fwd_pipeline.py old new"""
import random, sys
class Bar:
    def __init__(s, n): s.n=n; s.pending=n; s.tx=0; s.phase=0
    def arrive(s): s.pending-=1; s.check()
    def check(s):
        if s.pending<0: raise RuntimeError("over-arrive")
        if s.pending==0 and s.tx==0: s.phase+=1; s.pending=s.n
    def done(s, parity): return (s.phase & 1) != parity
STAGES=2; NWG=2
class St:
    def __init__(s): s.st=0; s.ph=0
    def adv(s, n=STAGES):
        s.st+=1
        if s.st==n: s.st=0; s.ph^=1
def run(tiles, seed, mode):
    rng=random.Random(seed)
    B={}
    for w in range(NWG): B[('qf',w)]=Bar(1); B[('qe',w)]=Bar(1)
    for st in range(STAGES):
        for x in 'kv': B[(x+'f',st)]=Bar(1); B[(x+'e',st)]=Bar(NWG)
    for r in range(2): B[('rf',r)]=Bar(1); B[('re',r)]=Bar(NWG)
    tma=[]; smem={}; errors=[]
    W=lambda bar,parity: (lambda: B[bar].done(parity))
    def producer():
        s=St(); qph=0; rs=St()
        for ti,t in enumerate(tiles):
            if t is not None:
                nmin,nmax,wgmax=t
                def load(x,n):
                    yield W((x+'e',s.st),s.ph^1)
                    B[(x+'f',s.st)].tx+=1; B[(x+'f',s.st)].arrive()
                    tma.append(((x+'f',s.st),(x,ti,n),(x,s.st)))
                    if mode=='old':
                        for w in range(NWG):
                            if n>=wgmax[w]: B[(x+'e',s.st)].arrive()
                yield from load('k',nmax-1)
                for w in range(NWG):
                    yield W(('qe',w),qph^1)
                    B[('qf',w)].tx+=1; B[('qf',w)].arrive(); tma.append((('qf',w),('q',ti),('q',w)))
                yield from load('v',nmax-1); s.adv()
                for n in range(nmax-2,nmin-1,-1):
                    yield from load('k',n); yield from load('v',n); s.adv()
                qph^=1
            # publish the next slot
            yield W(('re',rs.st),rs.ph^1); B[('rf',rs.st)].arrive(); rs.adv(2)
    def consumer(w):
        ks=St(); vs=St(); qph=0; rs=St()
        for ti,t in enumerate(tiles):
            if ti>0:  # receive
                yield W(('rf',rs.st),rs.ph); B[('re',rs.st)].arrive(); rs.adv(2)
            if t is None: continue
            nmin,nmax,wgmax=t
            own=wgmax[w]-nmin; skipped=nmax-wgmax[w]
            for i in range(skipped):
                if mode=='new':
                    yield W(('kf',ks.st),ks.ph); B[('ke',ks.st)].arrive(); ks.adv()
                    yield W(('vf',vs.st),vs.ph); B[('ve',vs.st)].arrive(); vs.adv()
                else:
                    ks.adv(); vs.adv()
            yield W(('qf',w),qph)
            if smem.get(('q',w))!=('q',ti): errors.append(('q',w))
            if own>0:
                n=wgmax[w]-1
                yield W(('kf',ks.st),ks.ph)
                if smem.get(('k',ks.st))!=('k',ti,n): errors.append(('k',w,n))
                yield 'step'
                B[('ke',ks.st)].arrive(); ks.adv()
                for n in range(wgmax[w]-2,nmin-1,-1):
                    yield W(('kf',ks.st),ks.ph)
                    if smem.get(('k',ks.st))!=('k',ti,n): errors.append(('k',w,n))
                    yield W(('vf',vs.st),vs.ph)
                    if smem.get(('v',vs.st))!=('v',ti,n+1): errors.append(('v',w,n+1))
                    yield 'step'
                    B[('ke',ks.st)].arrive(); ks.adv()
                    B[('ve',vs.st)].arrive(); vs.adv()
                yield W(('vf',vs.st),vs.ph)
                if smem.get(('v',vs.st))!=('v',ti,nmin): errors.append(('v',w,nmin))
                yield 'step'
                B[('ve',vs.st)].arrive(); vs.adv()
            yield 'step'
            B[('qe',w)].arrive(); qph^=1
    agents={'p':producer(),0:consumer(0),1:consumer(1)}
    cur={k:None for k in agents}
    while True:
        runnable=[k for k in agents if cur[k] is None or cur[k]=='step' or cur[k]()]
        opts=runnable+(['tma'] if tma else [])
        if not opts: return 'deadlock', errors
        c=rng.choice(opts)
        if c=='tma':
            i=rng.randrange(len(tma)); bar,tag,dest=tma.pop(i); smem[dest]=tag; B[bar].tx-=1; B[bar].check(); continue
        try: cur[c]=next(agents[c])
        except StopIteration: del agents[c]; del cur[c]
        if not agents and not tma: return 'ok', errors
T7=(0,4,[3,4]); T6=(0,3,[2,3]); T5=(0,1,[0,1])
for mode in sys.argv[1:]:
    res={}
    for seed in range(4000):
        rng=random.Random(seed+99999)
        tiles=[rng.choice([T7,T6,T5,None]) for _ in range(rng.randint(1,7))]
        try: r,e=run(tiles,seed,mode)
        except RuntimeError: r,e='overarrive',[1]
        key=(r,bool(e)); res[key]=res.get(key,0)+1
        if r=='deadlock' and res[key]<=2: print(mode,'deadlock',tiles)
    print(mode,res)
