"""Table for scripts/bench-ba-callgrind.sh (docs/benchmarks.md): medians of the 2 rounds, instructions per call from callgrind."""
import json, re, statistics as st
import sys
O = sys.argv[1] if len(sys.argv) > 1 else 'target/ba'
pt=[l.split() for l in open(f'{O}/perftest.txt') if re.match(r'^ *64 +\d+ ', l)]
rtt=2*float(pt[0][4]) if pt else float('nan')
def tot(p):
    for line in open(p):
        if line.startswith('summary:') or line.startswith('totals:'): return int(line.split()[1])
def cells(v):
    out={}
    for r in (1,2):
        for c in json.load(open(f'{O}/{v}-{r}.json'))['cells']:
            out.setdefault((c['path'],c['inflight']),[]).append(c)
    return out
print(f"perftest ib_send_lat 64 B polling round trip: {rtt:.1f} µs\n")
print("| 64 B, RDMA | before | after |\n|---|---:|---:|")
cs={v:cells(v) for v in ('before','after')}
def med(v,k,f): return st.median(c[f] for c in cs[v][k])
for inf in (1,8,64):
    row=[]
    for v in ('before','after'):
        p=med(v,('rdma',inf),'p50_us'); t=med(v,('tonic-tcp',inf),'p50_us')
        cps=med(v,('rdma',inf),'calls_per_s'); tcps=med(v,('tonic-tcp',inf),'calls_per_s')
        s=f"p50 {p/1000:.2f} ms"
        if inf==1: s+=f" ({p/rtt:.0f}× perftest, {p/t:.2f}× tonic p50)"
        else: s+=f", {cps/tcps:.2f}× tonic calls/s"
        s+=f", {med(v,('rdma',inf),'allocs_per_call'):.0f} allocs, {med(v,('rdma',inf),'ctx_switches_per_call'):.2f} ctx sw, CPU {med(v,('rdma',inf),'cpu_us_per_call'):.0f} µs"
        row.append(s)
    print(f"| × {inf} | {row[0]} | {row[1]} |")
ir={v:(tot(f'{O}/cg.{v}.400.out')-tot(f'{O}/cg.{v}.200.out'))/200 for v in ('before','after')}
print(f"| instructions per call (callgrind, 400−200 calls) | {ir['before']:,.0f} | {ir['after']:,.0f} |")
