# Developer targets. `make loadtest` runs Locust against a fresh local server
# (settings: see loadtest/run_locust.sh and loadtest/locustfile.py).
.PHONY: loadtest

loadtest:
	./loadtest/run_locust.sh
