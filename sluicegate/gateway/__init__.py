"""Sluicegate's HTTP gateway. Never imports torch."""
