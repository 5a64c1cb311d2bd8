import sys, statistics as st
rows = [list(map(float, l.split())) for l in open(sys.argv[1]) if l[0].isdigit()]
names = ["output max", "output rms", "stream max", "stream rms"]
print(f"{len(rows)} seeds")
for i, n in enumerate(names):
    old = [r[1 + i] for r in rows]; new = [r[5 + i] for r in rows]
    better = sum(b < a for a, b in zip(old, new))
    print(f"{n:11s} old mean {st.mean(old)*1e3:.3f} median {st.median(old)*1e3:.3f} | new mean {st.mean(new)*1e3:.3f} median {st.median(new)*1e3:.3f} | lower on {better}/{len(rows)}, mean diff {st.mean([b-a for a,b in zip(old,new)])*1e3:+.3f} sd {st.stdev([b-a for a,b in zip(old,new)])*1e3:.3f}")
