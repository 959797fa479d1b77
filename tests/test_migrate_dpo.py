"""engine migrate for TRL's DPOConfig and the alignment handbook's DPO recipes (vendored in tests/data/recipes):
a dpo run with DPOConfig's defaults; what the dpo plugin lacks is reported, never dropped. That the converted run
trains DPOTrainer's objective is plugins/dpo/tests/test_dpo.py (every run there is converted from a DPOConfig)."""

from pathlib import Path

from engine.tooling.migration import migrate, read_arguments

RECIPES = Path(__file__).parent / "data" / "recipes"


def test_the_handbooks_zephyr_dpo_recipes_migrate_to_dpo_runs(tmp_path):
    full = migrate(read_arguments(RECIPES / "zephyr-7b-beta-dpo-config_full.yaml"))
    assert full.mapping["plugins"] == ["hub", "dpo"] and full.mapping["dpo"] == {"beta": 0.01}
    data, train = full.mapping["data"], full.mapping["train"]
    assert (data["packing"], data["max_length"]) == (False, 1024)
    assert [source["split"] for source in data["mixture"]] == ["train_prefs", "test_prefs"]
    assert (train["learning_rate"], train["lr_scheduler_type"], train["gradient_accumulation_steps"]) == \
        (5e-7, "cosine", 2)
    lost = dict(full.lost)
    assert "max_prompt_length = 512" in lost  # TRL 1.16 has no such key; the engine cuts no prompt on its own
    qlora = migrate(read_arguments(RECIPES / "zephyr-7b-beta-dpo-config_qlora.yaml")).mapping
    assert set(qlora["plugins"]) >= {"dpo", "peft", "bnb"}
    assert qlora["peft"]["quantize"] == "4bit" and qlora["peft"]["r"] == 16
    assert qlora["train"]["optim"] == "paged_adamw_32bit"


def test_dpoconfigs_keys_the_plugin_lacks_are_reported_not_dropped():
    migration = migrate({"beta": 0.2, "rpo_alpha": 0.5, "use_weighting": True, "sync_ref_model": True,
                                "truncation_mode": "keep_end"})
    assert migration.mapping["dpo"] == {"beta": 0.2, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}
    lost = " ".join(what for what, _ in migration.lost)
    assert all(name in lost for name in ("use_weighting", "sync_ref_model", "truncation_mode"))


def test_the_docs_table_answers_every_dpoconfig_key_as_the_code_does():
    from engine.tooling.dpo_args import DPO_FIELDS

    page = (Path(__file__).resolve().parents[1] / "docs" / "migrate-sft.md").read_text()
    rows = [f"| `{name}` | {answer.describe(name).replace('|', chr(92) + '|')} |"
            for name, answer in DPO_FIELDS.items()]
    assert [row for row in rows if row not in page] == []  # stale: re-render the table into docs/migrate-sft.md
