"""The large-model study (issue 41): peak memory and synchronization time of every strategy on a 100M-parameter model."""
