# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
READY := $(VENV)/.ready

.PHONY: demo test bench docs docs-serve slurm-demo slurm-ft-demo clean

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
	$(VENV)/bin/python -m benchmarks.averaging.run

# The documentation site (mkdocs.yml, docs/) into site/, warnings as errors; docs-serve: live at http://127.0.0.1:8000.
docs: $(READY)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs build --strict --site-dir site

docs-serve: $(READY)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs serve --strict

# Not part of `make test`: installs Debian's slurm-wlm and munge when absent (root, apt-get), runs the
# sbatch example on a local 2-node SLURM cluster, preempts and requeues it, then stops the cluster.
slurm-demo: $(READY)
	examples/slurm/demo.sh

# Not part of `make test`: fault-tolerant DiLoCo (examples/fault_tolerant/diloco.sbatch) on a local 3-node SLURM
# cluster, one node's job step killed and started again by the sbatch.
slurm-ft-demo: $(READY)
	examples/fault_tolerant/slurm_demo.sh

clean:
	rm -rf $(VENV) site
