"""HTTP controllers. They find the shared services on ``app.state`` (set by ``create_app``):

- ``settings``: ``sluicegate.gateway.settings.Settings``
- ``redis``: ``redis.asyncio.Redis``
- ``db_sessionmaker``: ``async_sessionmaker[AsyncSession]`` (see ``sluicegate.gateway.db.session``)
- ``key_cache``: ``sluicegate.gateway.keys.cache.KeyCache``
- ``router``: the routing table; ``describe()`` lists models and deployments
- ``limiter``: ``sluicegate.gateway.admission.limits.RateLimiter`` (admission, and the budget counters it reads)
- ``prices``: ``sluicegate.gateway.usage.pricing.PriceBook``
"""
