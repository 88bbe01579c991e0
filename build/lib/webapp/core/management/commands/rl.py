"""`manage.py rl`: GRPO on toy tasks in real sandboxes (see training.train.rl)."""

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from training.train.grpo import GRPOConfig, GRPOConfigError, LengthPenaltyConfig
from training.train.loop import OptimizerConfig, TrainConfigError
from training.train.rl import RLConfig, rl


class Command(BaseCommand):
    help = "Reinforcement learning (GRPO) from a checkpoint on toy bug-fix tasks; re-run to resume."

    def add_arguments(self, parser):
        parser.add_argument("--run-dir", required=True)
        parser.add_argument("--init-checkpoint", required=True, help="Policy checkpoint (usually the SFT result).")
        parser.add_argument("--tasks", type=int, default=8)
        parser.add_argument("--task-seed-start", type=int, default=0)
        parser.add_argument("--tasks-per-step", type=int, default=2)
        parser.add_argument("--group-size", type=int, default=4)
        parser.add_argument("--steps", type=int, default=10)
        parser.add_argument("--updates-per-step", type=int, default=1)
        parser.add_argument("--micro-batch-size", type=int, default=1)
        parser.add_argument("--temperature", type=float, default=1.0)
        parser.add_argument("--max-turns", type=int, default=6)
        parser.add_argument("--max-tokens-per-turn", type=int, default=RLConfig.max_tokens_per_turn)
        parser.add_argument("--no-routing-replay", action="store_true")
        parser.add_argument("--partial-credit", action="store_true")
        parser.add_argument("--sandbox-backend", default=None)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--lr", type=float, default=1e-5)
        parser.add_argument("--clip-low", type=float, default=0.2)
        parser.add_argument("--clip-high", type=float, default=0.28)
        parser.add_argument("--normalize-advantage-std", action="store_true")
        parser.add_argument("--length-penalty", type=float, default=0.0, help="Length penalty coef (0: off).")
        parser.add_argument("--checkpoint-every", type=int, default=1)
        parser.add_argument("--record-owner", default=None,
                            help="Username to store every rollout under (trace browser); default: not stored.")
        parser.add_argument("--experiment-name", default=None, help="Experiment name of stored rollouts.")

    def handle(self, *args, **options):
        try:
            config = RLConfig(
                run_dir=options["run_dir"],
                init_checkpoint=options["init_checkpoint"],
                tasks=options["tasks"],
                task_seed_start=options["task_seed_start"],
                tasks_per_step=options["tasks_per_step"],
                group_size=options["group_size"],
                steps=options["steps"],
                updates_per_step=options["updates_per_step"],
                micro_batch_size=options["micro_batch_size"],
                temperature=options["temperature"],
                max_turns=options["max_turns"],
                max_tokens_per_turn=options["max_tokens_per_turn"],
                routing_replay=not options["no_routing_replay"],
                partial_credit=options["partial_credit"],
                sandbox_backend=options["sandbox_backend"],
                seed=options["seed"],
                checkpoint_every=options["checkpoint_every"],
                grpo=GRPOConfig(
                    clip_low=options["clip_low"],
                    clip_high=options["clip_high"],
                    normalize_advantage_std=options["normalize_advantage_std"],
                    length_penalty=LengthPenaltyConfig(coef=options["length_penalty"]),
                ),
                optimizer=OptimizerConfig(lr=options["lr"], warmup_steps=0, weight_decay=0.0, min_lr_ratio=1.0),
            )
            rl(config, on_step=lambda metrics: self.stdout.write(json.dumps(metrics)),
               on_rollouts=self._recorder(options))
        except (TrainConfigError, GRPOConfigError, ValueError, FileNotFoundError) as error:
            raise CommandError(str(error)) from error

    def _recorder(self, options):
        if not options["record_owner"]:
            return None
        from django.contrib.auth import get_user_model

        from webapp.agents.services import rollout_record

        owner = get_user_model().objects.filter(username=options["record_owner"]).first()
        if owner is None:
            raise CommandError(f"--record-owner {options['record_owner']!r} is not a user.")
        experiment = options["experiment_name"] or Path(options["run_dir"]).name

        def record(step, records, advantages):
            for rollout, advantage in zip(records, advantages, strict=True):
                if rollout.agent_result is None:
                    continue  # the sandbox never started: there is no trace to show
                rollout_record(
                    owner=owner, result=rollout.agent_result, prompt=rollout.prompt, experiment_name=experiment,
                    repo_label=rollout.task_id, model_name=f"{experiment}@{step - 1}", training_step=step,
                    reward=rollout.reward, advantage=advantage if rollout.valid else None,
                )

        return record
