"""trainer."""
