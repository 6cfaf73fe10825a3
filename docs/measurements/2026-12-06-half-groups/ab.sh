#!/bin/bash
# usage: ab.sh A B N [T list] -> per-pair ratio B/A medians for each T
A=$1; B=$2; N=$3; TS=${4:-1,11}; M=${M:-$HOME/.cache/mlx-spec/models/smollm2-135m-instruct}
for i in $(seq $N); do
  a=$(WINDOW_PROFILE_LOOP=${LOOP:-40} $A $M $TS 100 | sed 's/T= */T/;s/: forward */ /' | awk '{print $2}' | tr '\n' ' ')
  b=$(WINDOW_PROFILE_LOOP=${LOOP:-40} $B $M $TS 100 | sed 's/T= */T/;s/: forward */ /' | awk '{print $2}' | tr '\n' ' ')
  echo "$a| $b"
done | python3 -c "
import sys,statistics as st
rows=[l.split('|') for l in sys.stdin]
a=[list(map(float,r[0].split())) for r in rows]; b=[list(map(float,r[1].split())) for r in rows]
for j,t in enumerate('$TS'.split(',')):
  ra=[y[j]/x[j] for x,y in zip(a,b)]
  print('T=%s A med %.2f min %.2f | B med %.2f min %.2f | B/A pair-median %.3f'%(t,st.median([x[j] for x in a]),min(x[j] for x in a),st.median([x[j] for x in b]),min(x[j] for x in b),st.median(ra)))
"
