import json, glob, statistics as st, re
import os, sys
O=sys.argv[1] if len(sys.argv) > 1 else 'target/bench-ba'
pt=[l.split() for l in open(f'{O}/perftest.txt') if re.match(r'^ *64 +\d+ ', l)][0]
rtt=2*float(pt[4])  # 2 x t_typical
def cells(v, ct=False):
    out={}
    for f in sorted(glob.glob(f'{O}/{v}-{"ct-" if ct else ""}[0-9].json')):
        for c in json.load(open(f))['cells']:
            if c['error']: continue
            out.setdefault((c['path'],c['payload'],c['inflight']),[]).append(c)
    return out
B,A,Bc,Ac=cells('before'),cells('after'),cells('before',True),cells('after',True)
def med(l,k): return st.median(x[k] for x in l)
print(f"perftest ib_send_lat 64 B: t_typical {float(pt[4]):.2f} us, polling round trip {rtt:.1f} us\n")
print("| path | payload x in flight | p50 before -> after | x perftest RTT (after) | calls/s before -> after | allocs/call | ctx sw/call | CPU us/call |")
print("|---|---|---|---|---|---|---|---|")
def row(label,b,a,k):
    if k not in b or k not in a: return
    x,y=b[k],a[k]
    p,pl,i=k
    sz='64 B' if pl==64 else f'{pl>>20} MiB'
    print(f"| {p}{label} | {sz} x {i} | {med(x,'p50_us'):.0f} -> {med(y,'p50_us'):.0f} us | {med(y,'p50_us')/rtt:.1f}x | {med(x,'calls_per_s'):.0f} -> {med(y,'calls_per_s'):.0f} | {med(x,'allocs_per_call'):.1f} -> {med(y,'allocs_per_call'):.1f} | {med(x,'ctx_switches_per_call'):.2f} -> {med(y,'ctx_switches_per_call'):.2f} | {med(x,'cpu_us_per_call'):.0f} -> {med(y,'cpu_us_per_call'):.0f} |")
for k in sorted(B): row('',B,A,k)
for k in sorted(Bc): row(' (current_thread)',Bc,Ac,k)
for lab,b,a in (('rdma/tonic p50, 64 B x 1, before',B,None),):
    pass
for v,c in (('before',B),('after',A)):
    r=c.get(('rdma',64,1)); t=c.get(('tonic-tcp',64,1))
    if r and t: print(f"\n{v}: rdma p50 / tonic-tcp p50 (64 B x 1) = {med(r,'p50_us')/med(t,'p50_us'):.2f}x", end='')
print()
