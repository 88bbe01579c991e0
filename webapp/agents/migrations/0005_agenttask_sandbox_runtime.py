from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("agents", "0004_followups_branches_credentials"),
    ]

    operations = [
        migrations.AddField(
            model_name="agenttask",
            name="sandbox_runtime",
            field=models.CharField(
                blank=True, default="", max_length=64,
                help_text="OCI runtime (isolation tier) of the task's Docker sandbox; blank: SANDBOX_DOCKER_RUNTIME.",
            ),
        ),
    ]
