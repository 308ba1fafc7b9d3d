"""Sharing one deployment between projects: the fair-share claim order and the plan of when each
batch finishes (``fair_share``), quotas on what a project may enqueue (``quotas``), and spend caps
on what a batch may cost (``spend_cap``)."""
