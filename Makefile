# `make demo` and `make test` set everything up into .venv on a fresh machine (Python 3.11 + pip).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned so pip takes the CPU wheel on CPU machines; override on GPU hosts, e.g. TORCH=torch.
TORCH ?= torch==2.13.0

# Every process make starts writes the bytecode of the modules it imports, once, into .venv
# and the tree, even where PYTHONDONTWRITEBYTECODE is set (as on these machines: each rank,
# kernel and test worker then compiled its modules again, 0.3 s of CPU for axon_nb's alone).
# Compiling all 19,800 of .venv's modules at install took 38 s; `make test` imports 2,300 of
# them for a whole file of training tests (9 CPU-s, once).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test lint docs system-packages bench clean extension check-extension

install: $(VENV)/.installed

# Installing builds the JupyterLab extension (extension/) from source with this machine's node
# (pyproject's jupyter-builder hook runs jlpm install and build:prod); wheels ship it prebuilt.
# tools/install.py installs with uv (pip's settings passed on; pip where uv fails): 16 s
# against pip's 211 s here, leaving out what tools/leave_out.txt names.
$(VENV)/.installed: pyproject.toml extension/package.json tools/install.py tools/leave_out.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python tools/install.py $(VENV) "$(TORCH)" dev,hf,track,trainers,jobs,docs
	touch $@

# Rebuild the lab extension after changing extension/ (then reload JupyterLab).
extension: install
	cd extension && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm install && PATH="$(CURDIR)/$(BIN):$$PATH" jlpm build:prod
	$(BIN)/pip install -q --no-deps -e .

# The lab and server extensions are installed and enabled.
check-extension: install
	$(BIN)/jupyter labextension list 2>&1 | grep -E "axon-nb v[0-9.]+ .*enabled.*OK"
	$(BIN)/jupyter server extension list 2>&1 | grep -E "axon_nb.server .*OK"

demo: install
	$(BIN)/python -m axon_nb.notebooks examples/quickstart.ipynb --output build/quickstart.ipynb

# The documentation site (mkdocs.yml, docs/) into build/site; --strict: a warning (a broken
# link, a page missing from the nav, an API entry that does not resolve) fails the build.
docs: install
	$(BIN)/mkdocs build --strict --quiet -d build/site

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# Debian packages that tests drive for real: chromium (the browser tests), sshd and ip for
# other hosts made of network namespaces (tests/test_hosts.py), Slurm (tests/test_slurm.py).
# Whichever are missing come in one apt-get, without the packages they only recommend (43
# packages instead of 162: no perl, samba, avahi or cups); where they cannot (not root, no
# apt), the tests that need them are skipped and say why.
system-packages:
	@missing=""; \
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  missing="$$missing chromium"; \
	{ [ -x /usr/sbin/sshd ] && command -v ip >/dev/null; } || \
	  missing="$$missing openssh-server openssh-client iproute2"; \
	{ command -v slurmd >/dev/null || [ -x /usr/sbin/slurmd ]; } || \
	  missing="$$missing slurm-wlm munge"; \
	[ -z "$$missing" ] || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } || \
	  echo "could not install$$missing: the tests that need them will be skipped"

# Three pytest workers: tests wait (stops, hang timeouts, kernels and browsers starting), and
# with two the cores idled 10.6% of the run (pytest 797 s), with three 2.7% (736-751 s).
# The Debian packages install while uv installs the Python ones (not a global -j: goals named
# together, as in `make clean test`, would then run at the same time).
test:
	$(MAKE) --jobs=2 install system-packages
	$(MAKE) lint check-extension docs
	$(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder

bench: install
	$(BIN)/python benchmarks/cluster_start.py
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/dashboard_overhead.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/cell_latency.py
	$(BIN)/python benchmarks/data_loading.py
	$(BIN)/python benchmarks/bandwidth.py

clean:
	rm -rf $(VENV) build
