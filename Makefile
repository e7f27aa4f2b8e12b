# Developer targets. `make loadtest` sets up .venv (scripts/setup.sh) and runs Locust
# against a fresh local server
# (settings: see loadtest/run_locust.sh and loadtest/locustfile.py).
.PHONY: loadtest

loadtest:
	scripts/setup.sh
	./loadtest/run_locust.sh
