# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
READY := $(VENV)/.ready

.PHONY: demo test bench slurm-demo clean

$(READY): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt torch==2.13.0
	$(VENV)/bin/pip install -q -c constraints.txt -e ".[test,bench,docs]"
	touch $(READY)

demo: $(READY)
	$(VENV)/bin/python examples/lm_demo.py

test: $(READY)
	$(VENV)/bin/python -m pytest -q

bench: $(READY)
	$(VENV)/bin/python benchmarks/averaging.py

# Not part of `make test`: installs Debian's slurm-wlm and munge when absent (root, apt-get), runs the
# sbatch example on a local 2-node SLURM cluster, preempts and requeues it, then stops the cluster.
slurm-demo: $(READY)
	examples/slurm/demo.sh

clean:
	rm -rf $(VENV)
