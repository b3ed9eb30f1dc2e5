"""The serving simulator's parts: traffic, cost model, the run, the scenarios, the plots."""
