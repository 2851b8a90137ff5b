"""HTTP controllers. They find the shared services on ``app.state`` (set by ``create_app``):

- ``settings``: ``gateway.settings.Settings``
- ``redis``: ``redis.asyncio.Redis``
- ``db_sessionmaker``: ``async_sessionmaker[AsyncSession]`` (see ``gateway.db.session``)
- ``key_cache``: ``gateway.key_cache.KeyCache``
- ``router``: the routing table; ``describe()`` lists models and deployments
- ``limiter``: ``gateway.limits.RateLimiter`` (admission, and the budget counters it reads)
- ``prices``: ``gateway.pricing.PriceBook``
"""
