"""The protocol itself: no daemons, no networking policy."""
