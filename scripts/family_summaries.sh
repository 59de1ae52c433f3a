#!/bin/bash
# One debug job per family (debug=default: seconds to minutes each), for checking that a refactor leaves
# every family's summary.json numbers unchanged:
#   scripts/family_summaries.sh <checkout> <out>          (once per commit, each in its own checkout)
#   python -m experiments.common.compare_summaries <out of the old> <out of the new> --out <table.md>
# The checkout needs the data the tasks read (data/robomimic/lift/image_abs.hdf5: a symlink to yours).
set -u
checkout=$(cd "$1" && pwd); out=$2; mkdir -p "$out"; out=$(cd "$out" && pwd)
py=${PYTHON:-python}
while IFS=: read -r name args; do
  (cd "$checkout" && OMP_NUM_THREADS=1 PYTHONPATH="$checkout" timeout 900 "$py" run.py $args debug=default \
     logger=none "hydra.run.dir=$out/$name" > "$out/$name.log" 2>&1)
  echo "$name rc=$?"
done <<'JOBS'
feature_learning:task=feature_learning optim=dopr_sgd
humanoid:task=humanoid optim=dopr_adamw
lift:task=robomimic_lift optim=dopr_adamw
sit:task=sit_digits optim=dopr_adamw
llm:task=pretrain_arith optim=dopr_adamw
mup:task=mup_mlp_digits optim=dopr_adamw
graft:task=grafting_digits optim=dopr_adamw
JOBS
