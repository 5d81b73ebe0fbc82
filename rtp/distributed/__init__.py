"""Distributed plumbing: process groups and the rank-0 -> workers shared-memory channel."""
