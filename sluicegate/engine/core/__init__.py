"""Scheduling with no devices: scheduler, block manager, sequences, the waiting queue, their outputs."""
