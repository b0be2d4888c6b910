"""Ray actors that generate rollouts: a :class:`rollout.ray.actor.RolloutWorker` holds one backend
(``rollout.backend.build_backend``) and generates a :class:`rollout.ray.actor.Shard` of a step's
prompts; the :class:`rollout.ray.actor_pool.RolloutPool` spreads a step over its workers, pushes
new weights and replaces workers that fail."""
