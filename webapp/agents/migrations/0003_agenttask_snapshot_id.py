from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('agents', '0002_task_outcome'),
    ]

    operations = [
        migrations.AddField(
            model_name='agenttask',
            name='snapshot_id',
            field=models.CharField(blank=True, help_text='Sandbox snapshot of the latest attempt: links the task to its semantic index build.', max_length=200),
        ),
    ]
