from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("experiments", "0005_repositoryrecipe_snapshot")]

    operations = [
        migrations.AddField(
            model_name="repositoryrecipe",
            name="step",
            field=models.CharField(blank=True, help_text="The setup step running now, in words.", max_length=200),
        ),
    ]
