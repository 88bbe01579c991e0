from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('experiments', '0004_repositoryrecipe_setup_log_budget'),
    ]

    operations = [
        migrations.AddField(
            model_name='repositoryrecipe',
            name='snapshot',
            field=models.JSONField(blank=True, default=dict, help_text='The prepared snapshot the last ready setup built (kept; product tasks and mining start from it while the recipe is unchanged): backend, id, location, source, recipe fingerprint.'),
        ),
    ]
